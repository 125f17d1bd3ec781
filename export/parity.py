"""The parity gate: ONNX Runtime against the PyTorch fp32 model on random batches with random padding
and on a fixed set of real sentences (export/sentences.py).

Token vectors are compared at real tokens only (what sits at padding is undefined and never served);
the sentence vectors the server makes from them (mean over real tokens, and max) are compared too.
Past tolerance the export fails with the figures; `LIMITS` is the one place the limits live.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from artifact.manifest import (CLASSIFIER_LOGITS, CLS_EMBEDDING, INPUT_NAMES, MEAN_EMBEDDING, NSP_LOGITS,
                               POOLED_EMBEDDING, TOKEN_EMBEDDINGS)
from export import ExportError
from export.onnx_graph import EmbeddingGraph, served_outputs

# (batch, sequence length) of the checked batches; lengths are capped at the model's max length.
DEFAULT_SHAPES: tuple[tuple[int, int], ...] = ((1, 5), (2, 16), (5, 40), (8, 96), (4, 160))

# Sentence vectors computed from token_embeddings over the real tokens, as app/pooling.py serves them.
MEAN_POOLING = "mean_pooling"
MAX_POOLING = "max_pooling"


@dataclass(frozen=True)
class Limit:
    figure: str  # a figure's name, or "*" + a suffix: every figure that ends so
    op: str  # "<=" or ">="
    value: float
    why: str

    def applies(self, name: str) -> bool:
        return name.endswith(self.figure[1:]) if self.figure.startswith("*") else name == self.figure


FP32_MAX_ABS = 1e-4
FP16_MIN_COSINE = 0.999
FP16_MAX_NSP_PROB_DIFF = 0.01
INT8_MIN_COSINE = 0.995  # sentence vectors
INT8_TOKEN_MIN_COSINE = 0.97
INT8_MAX_SCORE_DIFF = 0.02  # a head's sigmoid / softmax (all-MiniLM-L6-v2 under a random head: 0.0011)

LIMITS: dict[str, tuple[Limit, ...]] = {
    "fp32": (
        Limit("*_max_abs", "<=", FP32_MAX_ABS, "same arithmetic as PyTorch in another order; a real bug is far larger"),
    ),
    "fp16": (
        Limit("*_min_cosine", ">=", FP16_MIN_COSINE, "fp16 rounding turns a vector by far less; a wrong kernel or mask by far more"),
        Limit("nsp_prob_max_diff", "<=", FP16_MAX_NSP_PROB_DIFF, "an NSP verdict must not move by more than 1 point"),
        Limit("classifier_score_max_diff", "<=", FP16_MAX_NSP_PROB_DIFF,
              "a classifier's score (sigmoid or softmax) must not move by more than 1 point"),
    ),
    "int8": (
        Limit(f"{CLS_EMBEDDING}_min_cosine", ">=", INT8_MIN_COSINE, "a served sentence vector: ranks like fp32's"),
        Limit(f"{POOLED_EMBEDDING}_min_cosine", ">=", INT8_MIN_COSINE, "a served sentence vector: ranks like fp32's"),
        Limit(f"{MAX_POOLING}_min_cosine", ">=", INT8_MIN_COSINE, "a sentence vector made from token vectors"),
        Limit(f"{MEAN_POOLING}_min_cosine", ">=", INT8_MIN_COSINE,
              "the sentence vector most models serve by default: ranks like fp32's"),
        Limit(f"{MEAN_EMBEDDING}_min_cosine", ">=", INT8_MIN_COSINE,
              "the same vector as the graph pools it: ranks like fp32's"),
        Limit(f"{TOKEN_EMBEDDINGS}_min_cosine", ">=", INT8_TOKEN_MIN_COSINE,
              "one token's vector carries its own noise, which a sentence vector averages out"),
        Limit("nsp_prob_max_diff", "<=", INT8_MAX_SCORE_DIFF, "an NSP verdict must not move by more than 2 points"),
        Limit("classifier_score_max_diff", "<=", INT8_MAX_SCORE_DIFF,
              "a classifier's score (sigmoid or softmax) must not move by more than 2 points"),
    ),
}


class ParityError(ExportError):
    """An ONNX graph's outputs differ from PyTorch's beyond tolerance."""


def random_batches(
    token_ids: Sequence[int], cls_id: int, sep_id: int, pad_id: int, max_length: int,
    shapes: Sequence[tuple[int, int]] = DEFAULT_SHAPES, seed: int = 0,
) -> list[dict[str, np.ndarray]]:
    """Feeds of real vocabulary ids, right-padded to random lengths; about half the rows are sentence
    pairs `[CLS] A [SEP] B [SEP]` with segment ids 1 on B. Row 0 fills the batch's length and, in every
    batch of two or more, row 1 is padded (the case a mask baked away at trace time gets wrong)."""
    rng = np.random.default_rng(seed)
    pool = np.asarray(token_ids, dtype=np.int64)
    batches = []
    for batch, seq_len in shapes:
        seq_len = max(3, min(seq_len, max_length))
        input_ids = np.full((batch, seq_len), pad_id, dtype=np.int64)
        token_type_ids = np.zeros_like(input_ids)
        lengths = rng.integers(3, seq_len + 1, size=batch)
        lengths[0] = seq_len
        if batch > 1:
            lengths[1] = rng.integers(3, max(4, seq_len // 2 + 1))
        for row, length in enumerate(lengths):
            words = rng.choice(pool, size=length)
            words[0] = cls_id
            words[-1] = sep_id
            if length >= 5 and rng.random() < 0.5:
                split = int(rng.integers(2, length - 2))  # words[split] ends segment A
                words[split] = sep_id
                token_type_ids[row, split + 1:length] = 1
            input_ids[row, :length] = words
        attention_mask = (np.arange(seq_len)[None, :] < lengths[:, None]).astype(np.int64)
        batches.append({"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids})
    return batches


def text_batches(tokenizer, sentences: Sequence[str], max_length: int, pad_id: int,
                 batch_size: int = 8) -> list[dict[str, np.ndarray]]:
    """Feeds of real text through the model's own tokenizer, right-padded: the sentences alone in
    batches of `batch_size`, then one batch of consecutive sentences as pairs (segment ids 1 on B).
    Rows longer than `max_length` keep their first max_length - 1 tokens and their last."""
    encodings = [tokenizer.encode(s) for s in sentences]
    firsts, seconds = sentences[0:2 * batch_size:2], sentences[1:2 * batch_size:2]
    encodings += [tokenizer.encode(a, b) for a, b in zip(firsts, seconds)]
    rows = [(e.ids, e.type_ids) if len(e.ids) <= max_length else
            (e.ids[:max_length - 1] + e.ids[-1:], e.type_ids[:max_length - 1] + e.type_ids[-1:]) for e in encodings]
    batches = []
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        width = max(len(ids) for ids, _ in chunk)
        input_ids = np.full((len(chunk), width), pad_id, dtype=np.int64)
        token_type_ids, attention_mask = np.zeros_like(input_ids), np.zeros_like(input_ids)
        for row, (ids, types) in enumerate(chunk):
            input_ids[row, :len(ids)], token_type_ids[row, :len(ids)], attention_mask[row, :len(ids)] = ids, types, 1
        batches.append({"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids})
    return batches


def reference_outputs(graph: EmbeddingGraph, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """PyTorch fp32 on the CPU, SDPA attention (the training kernel, not the one that was traced); the mean
    of the real token vectors (served_outputs) in float64 from them, as sentence-transformers pools."""
    with torch.no_grad():
        outs = graph(*(torch.from_numpy(feed[name]) for name in INPUT_NAMES))
    found = {name: out.float().numpy() for name, out in zip(graph.outputs, outs)}
    mask = feed["attention_mask"].astype(np.float64)[..., None]  # [B, S, 1]
    found[MEAN_EMBEDDING] = ((found[TOKEN_EMBEDDINGS] * mask).sum(1) / np.maximum(mask.sum(1), 1e-9)).astype(np.float32)
    return {name: found[name] for name in served_outputs(graph)}


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    cos = (a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-30)
    return float(cos.min())


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def measure(got: dict[str, np.ndarray], want: dict[str, np.ndarray], attention_mask: np.ndarray) -> dict[str, float]:
    """Differences for one batch: max abs per output, min cosine per vector output, NSP probability."""
    real = attention_mask.astype(bool)
    figures = {}
    for name, ref in want.items():
        out = got[name]
        if out.shape != ref.shape:
            raise ParityError(f"output {name} has shape {out.shape}, PyTorch gives {ref.shape}")
        if name == TOKEN_EMBEDDINGS:
            mask = real[..., None]  # [B, S, 1]
            count = mask.sum(1)
            figures.update(_vector_figures(MEAN_POOLING, (out * mask).sum(1) / count, (ref * mask).sum(1) / count))
            figures.update(_vector_figures(MAX_POOLING, np.where(mask, out, -np.inf).max(1),
                                           np.where(mask, ref, -np.inf).max(1)))  # [B, H]
            out, ref = out[real], ref[real]  # [N_real, H]
        if name == NSP_LOGITS:
            figures[f"{name}_max_abs"] = float(np.abs(out.astype(np.float64) - ref).max())
            figures["nsp_prob_max_diff"] = float(np.abs(_softmax(out.astype(np.float64)) - _softmax(ref)).max())
        elif name == CLASSIFIER_LOGITS:
            figures[f"{name}_max_abs"] = float(np.abs(out.astype(np.float64) - ref).max())
            figures["classifier_score_max_diff"] = float(np.abs(_scores(out.astype(np.float64)) - _scores(ref)).max())
        else:
            figures.update(_vector_figures(name, out, ref))
    return figures


def _scores(logits: np.ndarray) -> np.ndarray:
    """What /rerank and /predict answer: a sigmoid for one label, else a softmax."""
    return 1 / (1 + np.exp(-logits)) if logits.shape[-1] == 1 else _softmax(logits)


def _vector_figures(name: str, out: np.ndarray, ref: np.ndarray) -> dict[str, float]:
    return {f"{name}_max_abs": float(np.abs(out.astype(np.float64) - ref).max()),
            f"{name}_min_cosine": _min_cosine(out, ref)}


def compare(session, graph: EmbeddingGraph, batches: list[dict[str, np.ndarray]],
            references: list[dict[str, np.ndarray]] | None = None,
            outputs: list[str] | None = None) -> dict[str, float]:
    """Run `session` (an onnxruntime.InferenceSession, or anything with its `run`) on every batch; worst
    figures over all of them, for `outputs` (default: all of the graph's)."""
    names = list(outputs or served_outputs(graph))
    worst: dict[str, float] = {}
    for i, feed in enumerate(batches):
        want = references[i] if references is not None else reference_outputs(graph, feed)
        want = {name: want[name] for name in names}
        got = dict(zip(names, session.run(names, feed)))
        for key, value in measure(got, want, feed["attention_mask"]).items():
            pick = min if key.endswith("_min_cosine") else max
            worst[key] = pick(worst.get(key, value), value)
    worst["batches"] = float(len(batches))
    return worst


def limits(precision: str, figures: dict[str, float]) -> list[tuple[str, str, float]]:
    """(figure, "<=" or ">=", limit) that `precision` must meet: every LIMITS entry a figure matches."""
    if precision not in LIMITS:
        raise ValueError(f"unknown precision {precision!r}")
    return [(name, limit.op, limit.value) for limit in LIMITS[precision] for name in figures if limit.applies(name)]


def check_parity(precision: str, figures: dict[str, float]) -> None:
    """Raise ParityError (one line, with the figures) when `figures` are past `precision`'s limits."""
    checks = limits(precision, figures)
    if not checks:
        raise ParityError(f"{precision} graph: no parity figures to check")
    failed = [f"{key}={figures[key]:.6g} (limit {op} {limit:g})" for key, op, limit in checks
              if not (figures[key] <= limit if op == "<=" else figures[key] >= limit)]
    if failed:
        raise ParityError(f"{precision} graph differs from PyTorch fp32 beyond tolerance: {', '.join(failed)}")
