"""Pooling, normalisation, softmax and vector encodings, in numpy, outside the engine."""
from __future__ import annotations

import base64

import numpy as np

from artifact.manifest import CLS_EMBEDDING, POOLED_EMBEDDING, TOKEN_EMBEDDINGS

# The graph output each pooling reads.
POOLING_OUTPUT = {"cls": CLS_EMBEDDING, "pooled": POOLED_EMBEDDING, "mean": TOKEN_EMBEDDINGS}


def pool(outputs: dict[str, np.ndarray], pooling: str) -> np.ndarray:
    """[H] float32. `mean` averages the real tokens of this entry, [CLS] and [SEP] included (the batcher
    already cut its padding off), as sentence-transformers' mean pooling does."""
    if pooling == "mean":
        return outputs[TOKEN_EMBEDDINGS].mean(axis=0, dtype=np.float32)
    return outputs[POOLING_OUTPUT[pooling]]


def l2_normalize(v: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(v, axis=-1))
    return (v / max(norm, 1e-12)).astype(np.float32)


def softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def encode_vectors(v: np.ndarray, encoding_format: str) -> np.ndarray | str:
    """float: the array itself (orjson writes it); base64: its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode("ascii")
    return np.ascontiguousarray(v, dtype=np.float32)
