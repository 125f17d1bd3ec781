"""The inference wrapper around training.model's BERT and its trace to ONNX (TorchScript exporter, opset 17).

The exporter and the module shape are chosen for ONNX Runtime's BERT fusions: explicit matmul-softmax
attention with the additive (1 - mask) * -10000 bias, and a traced example batch with padding so the
mask stays a graph input (an all-ones example can let it be folded away).
"""
from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from artifact.manifest import (CLASSIFIER_LOGITS, CLS_EMBEDDING, INPUT_NAMES, MEAN_EMBEDDING, NSP_LOGITS,
                               POOLED_EMBEDDING, TOKEN_EMBEDDINGS)
from training.model import BertForPreTraining

OPSET = 17


def output_names(has_pooler: bool, has_nsp_head: bool, has_classifier: bool = False) -> list[str]:
    """The graph's outputs: heads that the checkpoint lacks are left out rather than served at random."""
    names = [TOKEN_EMBEDDINGS, CLS_EMBEDDING]
    if has_pooler:
        names.append(POOLED_EMBEDDING)
        if has_nsp_head:
            names.append(NSP_LOGITS)
        if has_classifier:
            names.append(CLASSIFIER_LOGITS)
    return names


def served_outputs(graph: "EmbeddingGraph") -> list[str]:
    """Every output of the exported graphs: the traced ones, then the mean of the real token vectors, which
    export adds after ONNX Runtime's fusions (export.mean_output)."""
    return [*graph.outputs, MEAN_EMBEDDING]


class EmbeddingGraph(nn.Module):
    """One forward pass -> every output the artifact offers, in `output_names` order.

    Inputs follow artifact.manifest.INPUT_NAMES order: (input_ids, attention_mask, token_type_ids)."""

    def __init__(self, model: BertForPreTraining, has_pooler: bool, has_nsp_head: bool,
                 classifier: nn.Linear | None = None):
        super().__init__()
        self.bert = model.bert
        self.seq_relationship = model.cls.seq_relationship
        self.classifier = classifier  # a sequence classifier's head on the pooler (dropout is off at inference)
        self.outputs = output_names(has_pooler, has_nsp_head, classifier is not None)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        sequence_output, pooled = self.bert(input_ids, token_type_ids, attention_mask)  # [B, S, H], [B, H]
        found = {TOKEN_EMBEDDINGS: sequence_output, CLS_EMBEDDING: sequence_output[:, 0]}
        if POOLED_EMBEDDING in self.outputs:
            found[POOLED_EMBEDDING] = pooled
        if NSP_LOGITS in self.outputs:
            found[NSP_LOGITS] = self.seq_relationship(pooled)  # [B, 2]
        if CLASSIFIER_LOGITS in self.outputs:
            found[CLASSIFIER_LOGITS] = self.classifier(pooled)  # [B, labels]
        return tuple(found[name] for name in self.outputs)


def example_batch(vocab_size: int, batch: int = 2, seq_len: int = 16) -> tuple[torch.Tensor, ...]:
    """A traced example with a padded row and a second segment, so neither the mask nor the
    token type path can be constant-folded."""
    g = torch.Generator().manual_seed(0)
    input_ids = torch.randint(min(5, vocab_size - 1), vocab_size, (batch, seq_len), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1:, seq_len // 2:] = 0
    token_type_ids = torch.zeros_like(input_ids)
    token_type_ids[:, seq_len // 4:] = 1
    return input_ids * attention_mask, attention_mask, token_type_ids * attention_mask


def trace_to_onnx(graph: EmbeddingGraph, path: Path) -> None:
    """fp32 ONNX graph at `path`, dynamic batch and sequence axes."""
    bert = graph.bert
    with bert.matmul_softmax_attention():  # the form ORT fuses into Attention
        dynamic_axes = {name: {0: "batch", 1: "sequence"} for name in (*INPUT_NAMES, TOKEN_EMBEDDINGS)}
        dynamic_axes.update({name: {0: "batch"} for name in graph.outputs if name != TOKEN_EMBEDDINGS})
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # the legacy exporter's deprecation notice and tracer chatter
            torch.onnx.export(
                graph.eval(),
                example_batch(bert.config.vocab_size),
                str(path),
                input_names=list(INPUT_NAMES),
                output_names=graph.outputs,
                dynamic_axes=dynamic_axes,
                opset_version=OPSET,
                do_constant_folding=True,
                dynamo=False,  # ORT's BERT fusions are written against the TorchScript exporter's patterns
            )
