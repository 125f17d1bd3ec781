"""Checkpoints of BERT's family read as BERT: for each model_type other than "bert", a reader
(training/distilbert.py, training/electra.py) maps its config.json and its tensors onto BERT's, and names
the architecture of its sequence classifiers and the activation their head puts where BERT's pooler has
tanh."""
from __future__ import annotations

import torch

from training import distilbert, electra

_READERS = {reader.MODEL_TYPE: reader for reader in (distilbert, electra)}
MODEL_TYPES = ("bert", *_READERS)  # the config.json model_types read
SEQUENCE_CLASSIFIERS = ("BertForSequenceClassification", *(r.SEQUENCE_CLASSIFIER for r in _READERS.values()))


def bert_config(raw_config: dict) -> dict:
    """config.json's contents as BERT's (a BERT config as it is); ValueError for a type outside the family."""
    kind = raw_config.get("model_type", "bert")
    if kind not in MODEL_TYPES:
        raise ValueError(f"not a BERT config: model_type is {kind!r}; read are {', '.join(MODEL_TYPES)}")
    reader = _READERS.get(kind)
    return reader.bert_config(raw_config) if reader else raw_config


def bert_state_dict(raw_config: dict, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in transformers' BERT names (a BERT checkpoint's as they are)."""
    reader = _READERS.get(raw_config.get("model_type"))
    return reader.bert_state_dict(state) if reader else state


def pooler_activation(architecture: str | None) -> torch.nn.Module | None:
    """What a sequence classifier of this architecture applies where BERT's pooler applies tanh; None for
    BERT's own, and for everything that is not such a classifier."""
    return next((r.POOLER_ACTIVATION() for r in _READERS.values() if r.SEQUENCE_CLASSIFIER == architecture), None)
