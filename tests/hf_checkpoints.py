"""Tiny random checkpoints as their libraries save them, with the test tokenizer beside them: the
transformers folders the family tests export, and a sentence-transformers model on one of them."""
from __future__ import annotations

import json
import shutil

import numpy as np
import torch

from export.pipeline import export_artifact


def vocab_size(tokenizer_dir) -> int:
    return len(json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"])


def saved_model(root, tokenizer_dir, model_class, config, seed: int):
    """(root, model): `model_class(config)` with seeded random weights, saved by transformers at `root`
    with tokenizer_dir's tokenizer.json beside it; the model in eval mode."""
    torch.manual_seed(seed)
    model = model_class(config).eval()
    model.save_pretrained(root)
    shutil.copy(tokenizer_dir / "tokenizer.json", root / "tokenizer.json")
    return root, model


def sentence_transformer_exported(st, encoder_folder, tmp_path, texts, shapes) -> np.ndarray:
    """A sentence-transformers model (the transformers folder at max length 24, mean Pooling, Normalize),
    saved by sentence-transformers at tmp_path/model and exported at tmp_path/art (checked to keep the
    pooling, normalising and length); returns its own `encode` of `texts`."""
    from sentence_transformers.models import Normalize, Pooling, Transformer

    encoder = Transformer(str(encoder_folder), max_seq_length=24)
    model = st.SentenceTransformer(modules=[encoder, Pooling(encoder.get_word_embedding_dimension(), "mean"),
                                            Normalize()], device="cpu")
    model.save(str(tmp_path / "model"))
    m = export_artifact(tmp_path / "model", tmp_path / "art", parity_shapes=shapes)
    assert (m.default_pooling, m.default_normalize, m.max_length) == ("mean", True, 24)
    return st.SentenceTransformer(str(tmp_path / "model"), device="cpu").encode(texts, convert_to_numpy=True)
