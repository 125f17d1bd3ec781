"""Pooling, normalisation, softmax and vector encodings, in numpy, outside the ONNX graph. The token
poolings run where the batch ran (pool_batch, in the batcher's thread): a request answers its pooled
vectors, not every token's, and with several HTTP workers only those cross the engine link. A pooled
vector that the graph itself answers (the mean, in artifacts exported since export.mean_output) is taken
from the graph instead, and the token vectors then stay on the device."""
from __future__ import annotations

import base64
from collections.abc import Iterable

import numpy as np

from artifact.manifest import CLS_EMBEDDING, MEAN_EMBEDDING, POOLED_EMBEDDING, POOLINGS, TOKEN_EMBEDDINGS


# sentence-transformers' Pooling modes over one input's real tokens ([len, H], the batcher already cut the
# padding off; [CLS] and [SEP] included, as there), each computed as its Pooling module does.
def _mean(t: np.ndarray) -> np.ndarray:
    return t.mean(axis=0, dtype=np.float32)


def _mean_sqrt_len(t: np.ndarray) -> np.ndarray:
    return t.sum(axis=0, dtype=np.float32) / np.float32(np.sqrt(len(t)))


def _max(t: np.ndarray) -> np.ndarray:
    return t.max(axis=0)


def _weightedmean(t: np.ndarray) -> np.ndarray:
    """Token i (from 1) weighs i: later tokens count more."""
    weights = np.arange(1, len(t) + 1, dtype=np.float32)
    return weights @ t / weights.sum()


def _lasttoken(t: np.ndarray) -> np.ndarray:
    return t[-1]  # the final [SEP] for BERT


_TOKEN_POOLINGS = {"mean": _mean, "mean_sqrt_len": _mean_sqrt_len, "max": _max, "weightedmean": _weightedmean,
                   "lasttoken": _lasttoken}
_POOLED_NAMES = {pooling: f"{pooling}_embedding" for pooling in _TOKEN_POOLINGS}
# The mean's name is the graph's own output's (export.mean_output): where the engine offers it, that answers.
assert _POOLED_NAMES["mean"] == MEAN_EMBEDDING
# The batcher's outputs that it pools from the graph's token vectors, [n, H] each, unless the graph offers
# one itself (pooled_here).
TOKEN_POOLED = {_POOLED_NAMES[pooling]: reduce for pooling, reduce in _TOKEN_POOLINGS.items()}
# The output each pooling answers: a graph output ("cls" is the first token, which the graph gives on its
# own), or one pooled from the token vectors.
POOLING_OUTPUT = {"cls": CLS_EMBEDDING, "pooled": POOLED_EMBEDDING, **_POOLED_NAMES}
assert set(POOLING_OUTPUT) == set(POOLINGS), "every pooling of the artifact contract is computed here"


def graph_outputs(outputs: frozenset[str], offered: frozenset[str]) -> frozenset[str]:
    """The graph outputs that give `outputs`: the token vectors for a pooled one the graph does not offer."""
    return frozenset(TOKEN_EMBEDDINGS if name in TOKEN_POOLED and name not in offered else name for name in outputs)


def pooled_here(answers: frozenset[str], offered: frozenset[str]) -> frozenset[str]:
    """Of `answers`, the pooled vectors that pool_batch makes: those the graph does not offer."""
    return answers.intersection(TOKEN_POOLED).difference(offered)


def pool_batch(token_vectors: np.ndarray, lengths: list[int], names: Iterable[str]) -> dict[str, np.ndarray]:
    """The pooled vectors `names` (TOKEN_POOLED's) of a batch: [B, H] each, row b from its first
    lengths[b] token vectors ([B, L, H], padded)."""
    return {name: np.stack([TOKEN_POOLED[name](token_vectors[b, :n]) for b, n in enumerate(lengths)])
            for name in names}


def available_poolings(has_pooler: bool) -> list[str]:
    """The poolings a model offers (its artifact's order; "pooled" needs BERT's pooler), and "none"."""
    return [p for p in POOLINGS if p != "pooled" or has_pooler] + ["none"]


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
