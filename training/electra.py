"""ELECTRA checkpoints read as BERT. ELECTRA's discriminator is BERT's encoder under the name `electra.`,
with BERT's config fields. A sequence classifier's head, gelu(dense([CLS])) then out_proj, is BERT's pooler
with a GELU for its tanh (POOLER_ACTIVATION) under BERT's classifier: cross-encoders such as
ms-marco-electra-base. Checkpoints whose embeddings are narrower than the encoder (ELECTRA-small's
embeddings_project) are refused: the exported graph has no such projection."""
from __future__ import annotations

import torch

MODEL_TYPE = "electra"
SEQUENCE_CLASSIFIER = "ElectraForSequenceClassification"
POOLER_ACTIVATION = torch.nn.GELU  # exact, as transformers' get_activation("gelu")

# ElectraForPreTraining's replaced-token head (as google/electra-*-discriminator ship): not served, and not
# BERT's MLM head either, so left out as transformers' ElectraModel leaves it.
_DISCRIMINATOR_HEAD = "discriminator_predictions."
_HEAD_NAMES = {"classifier.dense.": "pooler.dense.", "classifier.out_proj.": "classifier."}


def bert_config(raw_config: dict) -> dict:
    """An ELECTRA config.json's contents as a BERT config.json's."""
    hidden, embedding = raw_config.get("hidden_size"), raw_config.get("embedding_size")
    if embedding is not None and embedding != hidden:
        raise ValueError(f"embedding_size {embedding} differs from hidden_size {hidden} (an embeddings_project, as "
                         f"in ELECTRA-small), which the exported graph does not compute")
    return {**raw_config, "model_type": "bert"}


def bert_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An ElectraModel's, ElectraForPreTraining's or ElectraForSequenceClassification's tensors in transformers' BERT names (a bare
    BertModel's, plus `pooler.*` and `classifier.*` for a classifier's head). Tensors it does not know keep
    their names, for the loader to name."""
    out = {}
    for key, value in state.items():
        if key.startswith(_DISCRIMINATOR_HEAD):
            continue
        key = key.removeprefix("electra.")
        for old, new in _HEAD_NAMES.items():
            if key.startswith(old):
                key = new + key[len(old):]
                break
        out[key] = value
    return out
