"""Sentence pairs for MLM + NSP, built as google-research/bert's `create_instances_from_document`
builds them, but as token ranges into the shards (six integers per pair) instead of token lists.

A pair is `[CLS] A [SEP] B [SEP]`: A is one or more consecutive sentences of a document, B either the
sentences that follow A (IsNext) or a stretch of another random document (NotNext). Both stay
contiguous token ranges after truncation, which only ever removes tokens at either end.
"""
from __future__ import annotations

import random
from array import array
from collections.abc import Generator
from typing import NamedTuple

import numpy as np

from training.shards import TokenShards

IS_NEXT, NOT_NEXT = 0, 1  # NSP labels, as in transformers' BertForPreTraining

# Columns of the array `create_pairs` returns: A = tokens[a_start:a_end], B = tokens[b_start:b_end].
A_START, A_END, B_START, B_END, NSP_LABEL, TARGET_LENGTH = range(6)
PAIR_COLUMNS = 6


class Spans(NamedTuple):
    """Parts of documents to draw pairs from instead of whole documents: span i is sentences
    [first[i], end[i]) of document document[i]; a document may have several (int64 arrays, one row a span)."""

    first: np.ndarray
    end: np.ndarray
    document: np.ndarray


def truncation(len_a: int, len_b: int, max_num_tokens: int, rng: random.Random) -> tuple[int, int, int, int]:
    """Tokens to cut (A front, A back, B front, B back) so that A + B fits `max_num_tokens`.

    The same outcome as the original's loop (drop one token from the longer side — A on a tie — at the
    front or the back with equal chance, until it fits), computed in O(1)."""
    excess = len_a + len_b - max_num_tokens
    if excess <= 0:
        return 0, 0, 0, 0
    gap = min(excess, abs(len_a - len_b))
    cut_a, cut_b = (gap, 0) if len_a >= len_b else (0, gap)
    rest = excess - gap  # now equally long: the cuts alternate, A first
    cut_a, cut_b = cut_a + (rest + 1) // 2, cut_b + rest // 2
    front_a = rng.getrandbits(cut_a).bit_count() if cut_a else 0  # Binomial(cut_a, 1/2)
    front_b = rng.getrandbits(cut_b).bit_count() if cut_b else 0
    return front_a, cut_a - front_a, front_b, cut_b - front_b


def create_pairs(shards: TokenShards, document_ids: np.ndarray, max_seq_len: int, short_seq_prob: float,
                 rng: random.Random) -> np.ndarray:
    """All pairs of one pass over `document_ids`, in document order: int64 [pairs, PAIR_COLUMNS]."""
    return finish(draw_pairs(shards, document_ids, max_seq_len, short_seq_prob, rng))


def finish(drawing: Generator[None, None, np.ndarray]) -> np.ndarray:
    """What a drawing returns, after all its steps."""
    while True:
        try:
            next(drawing)
        except StopIteration as done:
            return done.value


def draw_pairs(shards: TokenShards, document_ids: np.ndarray, max_seq_len: int, short_seq_prob: float,
               rng: random.Random, documents_per_step: int | None = None, *,
               spans: Spans | None = None) -> Generator[None, None, np.ndarray]:
    """create_pairs as steps of `documents_per_step` documents each (None: one step), returning its array:
    a pass over a large corpus spread over many batches instead of run at once. With `spans`, pairs come
    from those parts of documents (each read as a document), and a NotNext B never from A's own document."""
    max_num_tokens = max_seq_len - 3  # [CLS] A [SEP] B [SEP]
    if spans is None:
        doc_starts = np.asarray(shards.document_starts)
        first_sentence = doc_starts[document_ids].tolist()
        end_sentence = doc_starts[np.asarray(document_ids) + 1].tolist()
        owner = None  # each its own document
    else:
        first_sentence, end_sentence, owner = spans.first.tolist(), spans.end.tolist(), spans.document.tolist()
    n_docs = len(first_sentence)
    sentence_starts = shards.sentence_starts
    out = array("q")
    for k in range(n_docs):
        if documents_per_step and k and k % documents_per_step == 0:
            yield
        # Sentence j of the document is tokens[starts[j]:starts[j + 1]].
        starts = sentence_starts[first_sentence[k]: end_sentence[k] + 1].tolist()
        n_sent = len(starts) - 1
        # As in the original, a document draws its target once: usually full length, sometimes shorter
        # to match the short inputs of fine-tuning.
        target = max_num_tokens
        if rng.random() < short_seq_prob:
            target = rng.randint(2, max_num_tokens)
        chunk_first, current_length, i = 0, 0, 0
        while i < n_sent:
            current_length += starts[i + 1] - starts[i]
            if i == n_sent - 1 or current_length >= target:
                n_chunk = i + 1 - chunk_first
                a_end = rng.randint(1, n_chunk - 1) if n_chunk >= 2 else 1
                a_start_tok, a_end_tok = starts[chunk_first], starts[chunk_first + a_end]
                if n_chunk == 1 or rng.random() < 0.5:
                    label = NOT_NEXT
                    b_start_tok, b_end_tok = _random_b(shards, first_sentence, end_sentence, owner, k, n_docs,
                                                       target - (a_end_tok - a_start_tok), rng)
                    i -= n_chunk - a_end  # the unused sentences start the next chunk
                else:
                    label = IS_NEXT
                    b_start_tok, b_end_tok = a_end_tok, starts[i + 1]
                fa, ba, fb, bb = truncation(a_end_tok - a_start_tok, b_end_tok - b_start_tok, max_num_tokens, rng)
                out.extend((a_start_tok + fa, a_end_tok - ba, b_start_tok + fb, b_end_tok - bb, label, target))
                chunk_first, current_length = i + 1, 0
            i += 1
    # a view of `out`'s memory (writable, and kept alive by it), not a copy: the pairs of a large corpus are
    # hundreds of MB, and a copy held twice that at the end of every draw (each data worker draws its own)
    return np.frombuffer(out, dtype=np.int64).reshape(-1, PAIR_COLUMNS)


def _random_b(shards: TokenShards, first_sentence: list[int], end_sentence: list[int], owner: list[int] | None,
              k: int, n_docs: int, target_b_length: int, rng: random.Random) -> tuple[int, int]:
    """Consecutive sentences of another document (`owner`: the document of each span; None, each its own),
    from a random one on, until `target_b_length`."""
    for _ in range(10):
        other = rng.randint(0, n_docs - 1)
        if (other != k) if owner is None else (owner[other] != owner[k]):
            break
    s0, s1 = first_sentence[other], end_sentence[other]
    first = rng.randint(s0, s1 - 1)
    starts = shards.sentence_starts
    # The first sentence whose end reaches the target (or the document's end).
    goal = int(starts[first]) + max(target_b_length, 1)
    last = min(int(np.searchsorted(starts[first + 1: s1 + 1], goal, side="left")) + first + 1, s1)
    return int(starts[first]), int(starts[last])


def balance_labels(pairs: np.ndarray, rng: random.Random) -> np.ndarray:
    """Drop randomly chosen pairs of the more frequent NSP label until IsNext and NotNext are equal.

    The original's rules force NotNext on every lone-sentence chunk, so a corpus of short documents
    (docstrings: about 35% IsNext) would teach NSP a prior instead of the task; "B is the real next
    sentence half the time" is the contract. Document order is kept."""
    labels = pairs[:, NSP_LABEL]
    is_next = np.flatnonzero(labels == IS_NEXT)
    not_next = np.flatnonzero(labels == NOT_NEXT)
    surplus, keep_all = (not_next, is_next) if len(not_next) > len(is_next) else (is_next, not_next)
    kept = rng.sample(range(len(surplus)), len(keep_all))
    chosen = np.sort(np.concatenate([keep_all, surplus[np.asarray(kept, dtype=np.int64)]]))
    return pairs[chosen]
