"""Pooling, normalisation, softmax and vector encodings, in numpy, outside the engine."""
from __future__ import annotations

import base64

import numpy as np

from artifact.manifest import CLS_EMBEDDING, POOLED_EMBEDDING, TOKEN_EMBEDDINGS

# The graph output each pooling reads.
POOLING_OUTPUT = {"cls": CLS_EMBEDDING, "pooled": POOLED_EMBEDDING, "mean": TOKEN_EMBEDDINGS}


def pool(outputs: dict, pooling: str) -> np.ndarray:
    """[n, H] float32, row i for input i. `mean` averages the real tokens of each input, [CLS] and [SEP]
    included (the batcher already cut the padding off), as sentence-transformers' mean pooling does."""
    if pooling == "mean":
        return np.stack([t.mean(axis=0, dtype=np.float32) for t in outputs[TOKEN_EMBEDDINGS]])
    return outputs[POOLING_OUTPUT[pooling]]


def l2_normalize(v: np.ndarray) -> np.ndarray:
    """Each row (or the one vector) to unit length; all-zero rows stay zero."""
    norms = np.linalg.norm(v, axis=-1, keepdims=True)
    return (v / np.maximum(norms, 1e-12)).astype(np.float32)


def softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def encode_vectors(v: np.ndarray, encoding_format: str) -> np.ndarray | str:
    """float: the array itself (orjson writes it); base64: its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.ascontiguousarray(v, dtype="<f4").tobytes()).decode("ascii")
    return np.ascontiguousarray(v, dtype=np.float32)


def encode_rows(m: np.ndarray, encoding_format: str) -> list[np.ndarray | str]:
    """Row i of an [n, H] block as item i's vector: one conversion for the block, then row views
    (orjson writes them) or base64 strings."""
    m = np.ascontiguousarray(m, dtype="<f4")
    if encoding_format == "base64":
        return [base64.b64encode(row.tobytes()).decode("ascii") for row in m]
    return list(m)
