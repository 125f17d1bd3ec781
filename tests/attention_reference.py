"""Softmax attention over packed sequences, computed the slow way: what bertserve.PackedAttention is held to
on the CPU (its host-reference build) and on the GPU (its CUDA kernel)."""
from __future__ import annotations

import math

import numpy as np


def softmax_attention(q, k, v, lengths, heads):
    """softmax(Q·Kᵀ/√d)·V for each sequence (rows packed back to back, `lengths` long) and head on its own,
    in float64."""
    out, start, size = np.zeros(q.shape), 0, q.shape[1] // heads
    for n in lengths:
        for h in range(heads):
            cols = slice(h * size, (h + 1) * size)
            qs, ks, vs = (x[start:start + n, cols].astype(np.float64) for x in (q, k, v))
            scores = qs @ ks.T / math.sqrt(size)
            weights = np.exp(scores - scores.max(axis=1, keepdims=True))
            out[start:start + n, cols] = weights / weights.sum(axis=1, keepdims=True) @ vs
        start += n
    return out
