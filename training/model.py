"""The one BERT definition: encoder, pooler and pre-training heads, shared by training and export.

Module and parameter names follow the layout of Hugging Face `transformers`' BertForPreTraining, so a
state dict moves between the two with no renaming (our checkpoints load there, theirs load here).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, fields
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from training.packed import PackedSequences, QueryRows, varlen_attention

# Additive mask value for padded keys, as in the original BERT. Finite so that it survives fp16 and
# bf16 (finfo.min overflows to -inf there and turns fully-masked rows into NaN).
MASK_NEGATIVE = -10000.0


@dataclass(frozen=True)
class BertConfig:
    """Model shape. Field names are those of `transformers`' config.json, so the file is shared."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    initializer_range: float = 0.02
    pad_token_id: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name} must be a positive whole number, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}"
            )
        # else torch fails on them with a traceback: building the embeddings, or tracing the LayerNorm
        for name, highest in (("layer_norm_eps", math.inf), ("hidden_dropout_prob", 1),
                              ("attention_probs_dropout_prob", 1)):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= highest:
                raise ValueError(f"{name} must be a number from 0 to {highest}, got {value!r}")
        pad = self.pad_token_id
        if not isinstance(pad, int) or isinstance(pad, bool) or not -self.vocab_size <= pad < self.vocab_size:
            raise ValueError(f"pad_token_id {pad!r} is not an id of the {self.vocab_size}-token vocabulary")

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_hf_dict(self) -> dict:
        """config.json contents that `transformers.BertConfig` reads as well as we do."""
        return {
            "model_type": "bert",
            "architectures": ["BertForPreTraining"],
            "hidden_act": "gelu",
            "position_embedding_type": "absolute",
            "tie_word_embeddings": True,
            **asdict(self),
        }

    @classmethod
    def from_hf_dict(cls, d: dict) -> "BertConfig":
        """Reads our config.json or any BERT config.json; unknown keys are ignored, bad ones rejected."""
        if d.get("model_type", "bert") != "bert":
            raise ValueError(f"not a BERT config: model_type is {d.get('model_type')!r}")
        act = d.get("hidden_act", "gelu")
        if act != "gelu":
            raise ValueError(f"unsupported hidden_act {act!r}: only exact 'gelu' (as in BERT) is implemented")
        pos = d.get("position_embedding_type", "absolute")
        if pos != "absolute":
            raise ValueError(f"unsupported position_embedding_type {pos!r}: only 'absolute' is implemented")
        # transformers runs a decoder's self-attention causally (a token sees none after it); ours is bidirectional
        for flag in ("is_decoder", "add_cross_attention"):
            if d.get(flag):
                raise ValueError(f"{flag} true: a decoder (causal attention, as BertLMHeadModel), not an encoder; "
                                 f"only bidirectional BERT encoders are implemented")
        types = d.get("type_vocab_size", 2)
        if isinstance(types, int) and not isinstance(types, bool) and types < 2:
            raise ValueError(f"type_vocab_size {types}: the model has no segment embedding for a pair's second text "
                             f"(segment 1), which pairs, NSP and the parity check need")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known and v is not None})


# Presets named in the README: layers / hidden / heads; the FFN is 4x hidden as in the paper.
PRESETS: dict[str, tuple[int, int, int]] = {
    "tiny": (2, 128, 2),
    "mini": (4, 256, 4),
    "small": (4, 512, 8),
    "medium": (8, 512, 8),
    "base": (12, 768, 12),
    "large": (24, 1024, 16),
}


def preset_config(name: str, vocab_size: int, max_position_embeddings: int = 512) -> BertConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    layers, hidden, heads = PRESETS[name]
    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        max_position_embeddings=max_position_embeddings,
    )


def additive_attention_mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, S] 1/0 mask -> [B, 1, 1, S] additive bias. Pure arithmetic, no data-dependent branch, so an
    ONNX trace keeps it for every batch (ORT's attention fusion recognises this exact shape of graph)."""
    extended = attention_mask[:, None, None, :].to(dtype)
    return (1.0 - extended) * MASK_NEGATIVE


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.register_buffer(
            "position_ids", torch.arange(config.max_position_embeddings).unsqueeze(0), persistent=False
        )

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """[B, S] ids -> [B, S, H]; or packed [T] ids with their `position_ids` -> [T, H]."""
        if position_ids is None:
            position_ids = self.position_ids[:, : input_ids.shape[1]]  # [1, S]
        x = (
            self.word_embeddings(input_ids)
            + self.token_type_embeddings(token_type_ids)
            + self.position_embeddings(position_ids)
        )
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    """Multi-head self-attention: `forward` over a padded batch, `forward_packed` over a packed one
    (training.packed)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_size = config.head_size
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout_p = config.attention_probs_dropout_prob
        # Padded attention runs SDPA, except inside BertModel.matmul_softmax_attention() (ONNX export).
        self.matmul_softmax = False

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        return x.view(b, s, self.num_heads, self.head_size).transpose(1, 2)  # [B, nh, S, hd]

    def _fused_qkv(self, hidden: torch.Tensor, *projections: nn.Linear) -> torch.Tensor:
        """Training: one [H -> n·H] matmul instead of n (query, key, value by default), on the same
        parameters concatenated per step (a copy of n·H² weights, small beside the activations).
        [..., H] -> [..., n, nh, hd]."""
        projections = projections or (self.query, self.key, self.value)
        weight = torch.cat([p.weight for p in projections])  # [n·H, H]
        bias = torch.cat([p.bias for p in projections])
        return F.linear(hidden, weight, bias).unflatten(-1, (len(projections), self.num_heads, self.head_size))

    def forward(self, hidden: torch.Tensor, attn_bias: torch.Tensor) -> torch.Tensor:
        """[B, S, H] with an additive [B, 1, 1, S] mask -> [B, S, H]."""
        b, s, h = hidden.shape
        ctx = self._matmul_softmax(hidden, attn_bias) if self.matmul_softmax else self._sdpa(hidden, attn_bias)
        return ctx.transpose(1, 2).reshape(b, s, h)  # [B, S, H]

    def _sdpa(self, hidden: torch.Tensor, attn_bias: torch.Tensor) -> torch.Tensor:
        if self.training:
            q, k, v = self._fused_qkv(hidden).permute(2, 0, 3, 1, 4).unbind(0)  # 3 x [B, nh, S, hd]
        else:
            q, k, v = self._heads(self.query(hidden)), self._heads(self.key(hidden)), self._heads(self.value(hidden))
        dropout_p = self.dropout_p if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias.to(q.dtype), dropout_p=dropout_p)

    def _matmul_softmax(self, hidden: torch.Tensor, attn_bias: torch.Tensor) -> torch.Tensor:
        """Attention written out, with separate projections: the pattern ONNX Runtime fuses into its
        Attention kernel."""
        q, k, v = self._heads(self.query(hidden)), self._heads(self.key(hidden)), self._heads(self.value(hidden))
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_size)  # [B, nh, S, S]
        probs = torch.softmax(scores + attn_bias, dim=-1)
        probs = F.dropout(probs, self.dropout_p, self.training)
        return torch.matmul(probs, v)  # [B, nh, S, hd]

    def forward_packed(self, hidden: torch.Tensor, packed: PackedSequences,
                       queries: QueryRows | None = None) -> torch.Tensor:
        """Packed [T, H] with its PackedSequences -> [T, H], or the rows of `queries` only."""
        if queries is None:
            q, k, v = self._fused_qkv(hidden).unbind(1)  # 3 x [T, nh, hd], strided views: no copies
        else:
            q = self._fused_qkv(hidden.index_select(0, queries.index), self.query).squeeze(1)
            k, v = self._fused_qkv(hidden, self.key, self.value).unbind(1)
        dropout_p = self.dropout_p if self.training else 0.0
        return varlen_attention(q, k, v, packed, dropout_p, queries).flatten(1)  # [T or rows, H]


class BertResidualOutput(nn.Module):
    """dense -> dropout -> + residual -> LayerNorm: the post-LN tail of both sub-layers, as in the paper."""

    def __init__(self, config: BertConfig, in_features: int):
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(x)) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertResidualOutput(config, config.hidden_size)

    def forward(self, hidden: torch.Tensor, attn_bias: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(hidden, attn_bias), hidden)

    def forward_packed(self, hidden: torch.Tensor, packed: PackedSequences,
                       queries: QueryRows | None = None) -> torch.Tensor:
        residual = hidden if queries is None else hidden.index_select(0, queries.index)
        return self.output(self.self.forward_packed(hidden, packed, queries), residual)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))  # exact (erf) GELU, as BERT and transformers' "gelu"


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertResidualOutput(config, config.intermediate_size)

    def forward(self, hidden: torch.Tensor, attn_bias: torch.Tensor) -> torch.Tensor:
        attended = self.attention(hidden, attn_bias)
        return self.output(self.intermediate(attended), attended)

    def forward_packed(self, hidden: torch.Tensor, packed: PackedSequences,
                       queries: QueryRows | None = None) -> torch.Tensor:
        """Every row out, or with `queries` only theirs: from there on a layer is row-wise."""
        attended = self.attention.forward_packed(hidden, packed, queries)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, hidden: torch.Tensor, attn_bias: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            hidden = layer(hidden, attn_bias)
        return hidden

    def forward_packed(self, hidden: torch.Tensor, packed: PackedSequences,
                       output_rows: QueryRows | None = None) -> torch.Tensor:
        """Token vectors of every row, or of `output_rows` only: the last layer then computes nothing
        else, since no later layer reads the other rows."""
        *inner, last = self.layer
        for layer in inner:
            hidden = layer.forward_packed(hidden, packed)
        return last.forward_packed(hidden, packed, output_rows)


class BertPooler(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation: nn.Module = nn.Tanh()  # BERT's; a DistilBERT classifier's head reads as this with ReLU

    def forward(self, first_tokens: torch.Tensor) -> torch.Tensor:
        return self.activation(self.dense(first_tokens))  # [B, H] from the [CLS] vectors


class BertModel(nn.Module):
    """Bare encoder: ids -> (token vectors [B, S, H], pooled [CLS] vector [B, H]); packed (training),
    `forward_packed`."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config)

    @contextlib.contextmanager
    def matmul_softmax_attention(self) -> Iterator[None]:
        """Within the block, padded attention is written out as matmul -> softmax -> matmul instead of
        SDPA: the same result, in the form ONNX Runtime fuses into its Attention kernel (for an ONNX trace)."""
        attentions = [layer.attention.self for layer in self.encoder.layer]
        for attention in attentions:
            attention.matmul_softmax = True
        try:
            yield
        finally:
            for attention in attentions:
                attention.matmul_softmax = False

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor,
                attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.embeddings(input_ids, token_type_ids)  # [B, S, H]
        attn_bias = additive_attention_mask(attention_mask, hidden.dtype)  # [B, 1, 1, S]
        sequence_output = self.encoder(hidden, attn_bias)
        return sequence_output, self.pooler(sequence_output[:, 0])

    def forward_packed(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor, packed: PackedSequences,
                       output_rows: QueryRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """ids [T] -> (token vectors [T, H], pooled [B, H]); with `output_rows` (QueryRows whose first row
        of each sequence is its [CLS]), the token vectors of those rows only."""
        hidden = self.embeddings(input_ids, token_type_ids, packed.position_ids)  # [T, H]
        sequence_output = self.encoder.forward_packed(hidden, packed, output_rows)
        if output_rows is None:
            return sequence_output, self.pooler(sequence_output[packed.first_tokens])
        return sequence_output, self.pooler(sequence_output[::output_rows.per_sequence])


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(F.gelu(self.dense(x)))


class BertLMPredictionHead(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size, bias=False)  # weight tied to embeddings
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.transform(x)) + self.bias


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)  # index 0 = IsNext, as in transformers


class PreTrainingOutput(NamedTuple):
    loss: torch.Tensor | None
    mlm_loss: torch.Tensor | None
    nsp_loss: torch.Tensor | None
    mlm_logits: torch.Tensor  # [N, V] for the predicted positions when labels are given, else [B, S, V]
    nsp_logits: torch.Tensor  # [B, 2]


class BertForPreTraining(nn.Module):
    """Encoder plus MLM and NSP heads; loss = MLM + NSP as in the paper."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.bert = BertModel(config)
        self.cls = BertPreTrainingHeads(config)
        self.cls.predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=std)
            if module.padding_idx is not None:
                with torch.no_grad():
                    module.weight[module.padding_idx].zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def forward(
        self,
        input_ids: torch.Tensor,
        token_type_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        mlm_labels: torch.Tensor | None = None,
        nsp_labels: torch.Tensor | None = None,
        masked_positions: torch.Tensor | None = None,
        packed: PackedSequences | None = None,
    ) -> PreTrainingOutput:
        """`mlm_labels` is [B, S] with -100 where nothing is predicted; or, with `masked_positions`
        ([B, P] indices into the sequence), [B, P] labels of those positions (-100 in unused slots).

        With `packed`, the batch comes without padding (training.packed): ids and token types are [T],
        `attention_mask` is unused, and `masked_positions` index the [T] packed tokens."""
        output_rows = None
        if packed is None:
            sequence_output, pooled = self.bert(input_ids, token_type_ids, attention_mask)
        else:
            if mlm_labels is not None:  # the last layer computes [CLS] and the masked rows only
                output_rows = QueryRows.for_heads(packed, masked_positions)
            sequence_output, pooled = self.bert.forward_packed(input_ids, token_type_ids, packed, output_rows)
        nsp_logits = self.cls.seq_relationship(pooled)  # [B, 2]
        if mlm_labels is None:
            return PreTrainingOutput(None, None, None, self.cls.predictions(sequence_output), nsp_logits)
        # The vocabulary projection is the costliest matmul: run it on the ~15% masked positions only.
        if output_rows is not None:
            per_sequence = sequence_output.unflatten(0, (-1, output_rows.per_sequence))  # [B, 1 + P, H]
            picked = per_sequence[:, 1:].flatten(0, 1)  # [B*P, H], in masked_positions' order
            labels = mlm_labels.flatten()
        elif masked_positions is not None:
            # A fixed-shape gather, so torch.compile traces one graph (a boolean index has a data-dependent size).
            index = masked_positions.unsqueeze(-1).expand(-1, -1, sequence_output.shape[-1])  # [B, P, H]
            picked = sequence_output.gather(1, index).flatten(0, 1)  # [B*P, H]
            labels = mlm_labels.flatten()  # [B*P]
        else:
            masked = mlm_labels != -100  # [B, S]
            picked, labels = sequence_output[masked], mlm_labels[masked]  # [N_masked, H], [N_masked]
        mlm_logits = self.cls.predictions(picked)  # [N_masked or B*P, V]
        mlm_loss = F.cross_entropy(mlm_logits.float(), labels, ignore_index=-100)
        loss = mlm_loss
        nsp_loss = None
        if nsp_labels is not None:
            nsp_loss = F.cross_entropy(nsp_logits.float(), nsp_labels)
            loss = mlm_loss + nsp_loss
        return PreTrainingOutput(loss, mlm_loss, nsp_loss, mlm_logits, nsp_logits)
