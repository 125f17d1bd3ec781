"""DistilBERT checkpoints read as BERT. DistilBERT is BERT's encoder with other tensor names, no token-type
embeddings and no pooler: its config maps onto BERT's, and its tensors onto ours, with the token-type
embeddings all zero (so a pair's segments change nothing, as in DistilBERT). An MLM head
(DistilBertForMaskedLM) maps onto BERT's. A sequence classifier's head, relu(pre_classifier([CLS])) then
`classifier`, is BERT's pooler with a ReLU for its tanh (POOLER_ACTIVATION) under BERT's classifier."""
from __future__ import annotations

import re

import torch

MODEL_TYPE = "distilbert"
SEQUENCE_CLASSIFIER = "DistilBertForSequenceClassification"
POOLER_ACTIVATION = torch.nn.ReLU  # of pre_classifier, read as BERT's pooler

_CONFIG_NAMES = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
                 "hidden_dim": "intermediate_size", "activation": "hidden_act"}
_SHARED_CONFIG = ("vocab_size", "max_position_embeddings", "pad_token_id", "initializer_range")
# Within a layer: DistilBERT's module -> BERT's
_LAYER_NAMES = {"attention.q_lin": "attention.self.query", "attention.k_lin": "attention.self.key",
                "attention.v_lin": "attention.self.value", "attention.out_lin": "attention.output.dense",
                "sa_layer_norm": "attention.output.LayerNorm", "ffn.lin1": "intermediate.dense",
                "ffn.lin2": "output.dense", "output_layer_norm": "output.LayerNorm"}
_HEAD_NAMES = {"vocab_transform": "cls.predictions.transform.dense",
               "vocab_layer_norm": "cls.predictions.transform.LayerNorm", "pre_classifier": "pooler.dense"}
_LAYER = re.compile(r"^transformer\.layer\.(\d+)\.(.+)\.(weight|bias)$")
TYPE_VOCAB_SIZE = 2  # [CLS] A [SEP] B [SEP] still carries segments 0 and 1; both embed to zero


def bert_config(raw_config: dict) -> dict:
    """A DistilBERT config.json's contents as a BERT config.json's."""
    # sinusoidal_pos_embds: the table is stored with the weights all the same
    bert = {new: raw_config[old] for old, new in _CONFIG_NAMES.items() if old in raw_config}
    bert.update({k: raw_config[k] for k in _SHARED_CONFIG if k in raw_config})
    return {**bert, "model_type": "bert", "type_vocab_size": TYPE_VOCAB_SIZE, "layer_norm_eps": 1e-12}


def bert_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A DistilBertModel's, DistilBertForMaskedLM's or DistilBertForSequenceClassification's tensors in
    transformers' BERT names (a bare BertModel's, plus `cls.*` for the MLM head, `pooler.*` and
    `classifier.*` for a classifier's head), with zero token-type embeddings added. Tensors it does not
    know keep their names (prefixed as a bare model's), for the loader to name."""
    out = {}
    for key, value in state.items():
        key = key.removeprefix("distilbert.")
        if (layer := _LAYER.match(key)) and layer.group(2) in _LAYER_NAMES:
            index, module, kind = layer.groups()
            out[f"encoder.layer.{index}.{_LAYER_NAMES[module]}.{kind}"] = value
        elif key.startswith("embeddings."):
            out[key] = value
        elif (module := key.rsplit(".", 1)[0]) in _HEAD_NAMES:
            out[f"{_HEAD_NAMES[module]}.{key.rsplit('.', 1)[1]}"] = value
        elif key == "vocab_projector.bias":
            out["cls.predictions.bias"] = value
        elif key != "vocab_projector.weight":  # tied to the word embeddings, as BERT's decoder is
            out[key] = value
    words = out.get("embeddings.word_embeddings.weight")
    if words is not None:
        out["embeddings.token_type_embeddings.weight"] = torch.zeros(TYPE_VOCAB_SIZE, words.shape[1], dtype=words.dtype)
    return out
