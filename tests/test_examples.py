"""Sentence pairs: the original BERT construction, checked against a port of it and by statistics
over thousands of pairs."""
from __future__ import annotations

import random

import numpy as np
import pytest

from data_corpora import document_of, prepare, write_txt_corpus
from training.examples import (A_END, A_START, B_END, B_START, IS_NEXT, NOT_NEXT, NSP_LABEL, PAIR_COLUMNS,
                               TARGET_LENGTH, balance_labels, create_pairs, truncation)

MAX_SEQ_LEN = 64
MAX_NUM_TOKENS = MAX_SEQ_LEN - 3


@pytest.fixture(scope="module")
def long_docs(tmp_path_factory):
    """Documents of 150-250 sentences, so that few chunks are a lone sentence at a document's end (the
    original always pairs those with a random B). Short targets are off for the same reason: a
    document with target 5 is cut into one-sentence chunks, all NotNext (see the port test below)."""
    tmp = tmp_path_factory.mktemp("long_docs")
    corpus = write_txt_corpus(tmp / "c.txt", n_docs=200, sentences=(150, 250), words=(3, 10))
    return prepare(tmp, corpus, max_seq_len=MAX_SEQ_LEN, short_seq_prob=0.0)


def _pairs(data, epoch=0):
    return data.train.pairs(epoch)


def test_about_half_the_pairs_are_is_next(long_docs):
    pairs = _pairs(long_docs)
    assert len(pairs) >= 5000
    is_next = np.mean(pairs[:, NSP_LABEL] == IS_NEXT)
    assert abs(is_next - 0.5) < 0.03, is_next


def test_segments_are_non_empty_and_fit(long_docs):
    pairs = _pairs(long_docs)
    len_a, len_b = pairs[:, A_END] - pairs[:, A_START], pairs[:, B_END] - pairs[:, B_START]
    assert (len_a >= 1).all() and (len_b >= 1).all()
    assert (len_a + len_b <= MAX_NUM_TOKENS).all()
    # Most pairs are filled close to the limit (short targets and document ends aside).
    assert np.mean(len_a + len_b >= MAX_NUM_TOKENS - 12) > 0.6


def test_is_next_b_follows_a_in_the_same_document(long_docs):
    shards = long_docs.train.shards
    pairs = _pairs(long_docs)
    nxt = pairs[pairs[:, NSP_LABEL] == IS_NEXT]
    doc_a, doc_b = document_of(shards, nxt[:, A_START]), document_of(shards, nxt[:, B_END] - 1)
    assert (doc_a == doc_b).all()
    assert (nxt[:, A_END] <= nxt[:, B_START]).all()
    # They met at a sentence boundary, before truncation took tokens off A's back and B's front.
    boundary = np.asarray(shards.sentence_starts)[np.searchsorted(shards.sentence_starts, nxt[:, A_END])]
    assert (boundary <= nxt[:, B_START]).all()
    met = nxt[:, A_END] == nxt[:, B_START]
    assert 0.2 < met.mean() < 1 and np.isin(nxt[met, A_END], shards.sentence_starts).all()


def test_not_next_b_comes_from_another_document(long_docs):
    shards = long_docs.train.shards
    pairs = _pairs(long_docs)
    rnd = pairs[pairs[:, NSP_LABEL] == NOT_NEXT]
    doc_a, doc_b = document_of(shards, rnd[:, A_START]), document_of(shards, rnd[:, B_START])
    assert (doc_a != doc_b).all()
    assert (document_of(shards, rnd[:, B_END] - 1) == doc_b).all()
    assert np.isin(doc_b, long_docs.train.document_ids).all()  # never a held-out document


def test_about_one_document_in_ten_gets_a_short_target(tmp_path):
    corpus = write_txt_corpus(tmp_path / "c.txt", n_docs=5000, sentences=(2, 3), words=(3, 6), made_up=0)
    data = prepare(tmp_path, corpus, max_seq_len=MAX_SEQ_LEN, heldout_fraction=0)
    pairs = data.train.pairs(0)
    first_of_doc = np.unique(document_of(data.train.shards, pairs[:, A_START]), return_index=True)[1]
    targets = pairs[first_of_doc, TARGET_LENGTH]
    # randint(2, max_num_tokens) also draws the full length once in max_num_tokens - 1 times.
    expected = 0.1 * (1 - 1 / (MAX_NUM_TOKENS - 1))
    assert abs(np.mean(targets < MAX_NUM_TOKENS) - expected) < 0.015
    assert targets.min() >= 2
    short = pairs[:, TARGET_LENGTH] < MAX_NUM_TOKENS
    length = pairs[:, A_END] - pairs[:, A_START] + pairs[:, B_END] - pairs[:, B_START]
    assert length[short].mean() < length[~short].mean()


def test_pairs_differ_per_epoch_and_repeat_per_epoch(long_docs):
    a, b = long_docs.train.pairs(0), long_docs.train.pairs(1)
    assert not np.array_equal(a, b)
    assert np.array_equal(long_docs.train.pairs(0), a)


# --- the original algorithm, ported as is ---------------------------------------------------------

def _reference_pairs(all_documents, max_seq_length, short_seq_prob, rng):
    """google-research/bert create_instances_from_document over every document, tokens being global
    positions; returns the same columns as create_pairs. Truncation must not be needed."""
    out = []
    for document_index, document in enumerate(all_documents):
        max_num_tokens = max_seq_length - 3
        target_seq_length = max_num_tokens
        if rng.random() < short_seq_prob:
            target_seq_length = rng.randint(2, max_num_tokens)
        current_chunk, current_length, i = [], 0, 0
        while i < len(document):
            segment = document[i]
            current_chunk.append(segment)
            current_length += len(segment)
            if i == len(document) - 1 or current_length >= target_seq_length:
                if current_chunk:
                    a_end = 1
                    if len(current_chunk) >= 2:
                        a_end = rng.randint(1, len(current_chunk) - 1)
                    tokens_a = [t for j in range(a_end) for t in current_chunk[j]]
                    tokens_b = []
                    if len(current_chunk) == 1 or rng.random() < 0.5:
                        is_random_next = True
                        target_b_length = target_seq_length - len(tokens_a)
                        for _ in range(10):
                            random_document_index = rng.randint(0, len(all_documents) - 1)
                            if random_document_index != document_index:
                                break
                        random_document = all_documents[random_document_index]
                        random_start = rng.randint(0, len(random_document) - 1)
                        for j in range(random_start, len(random_document)):
                            tokens_b.extend(random_document[j])
                            if len(tokens_b) >= target_b_length:
                                break
                        i -= len(current_chunk) - a_end
                    else:
                        is_random_next = False
                        for j in range(a_end, len(current_chunk)):
                            tokens_b.extend(current_chunk[j])
                    assert len(tokens_a) + len(tokens_b) <= max_num_tokens, "test corpus needs truncation"
                    out.append((tokens_a[0], tokens_a[-1] + 1, tokens_b[0], tokens_b[-1] + 1,
                                int(is_random_next), target_seq_length))
                current_chunk, current_length = [], 0
            i += 1
    return np.array(out, dtype=np.int64)


def test_pairs_match_the_original_algorithm(tmp_path):
    corpus = write_txt_corpus(tmp_path / "c.txt", n_docs=400, sentences=(1, 6), words=(2, 5), made_up=0)
    data = prepare(tmp_path, corpus, max_seq_len=128, vocab_size=1000, heldout_fraction=0)
    shards, ds = data.train.shards, data.train
    starts = shards.sentence_starts
    documents = []
    for d in ds.document_ids:
        s0, s1 = shards.document_starts[d], shards.document_starts[d + 1]
        documents.append([list(range(starts[s], starts[s + 1])) for s in range(s0, s1)])
    assert max(sum(map(len, doc)) for doc in documents) <= (128 - 3) // 2  # so nothing is truncated
    ours = create_pairs(shards, ds.document_ids, 128, 0.3, random.Random(7))
    assert np.array_equal(ours, _reference_pairs(documents, 128, 0.3, random.Random(7)))


def _truncate_loop(len_a, len_b, max_num_tokens, rng):
    """The original truncate_seq_pair, on lengths: (A front, A back, B front, B back) cuts."""
    cuts = [0, 0, 0, 0]
    while len_a + len_b > max_num_tokens:
        side = 0 if len_a >= len_b else 2
        cuts[side + (0 if rng.random() < 0.5 else 1)] += 1
        len_a, len_b = (len_a - 1, len_b) if side == 0 else (len_a, len_b - 1)
    return cuts


def test_truncation_matches_the_original_loop():
    rng = random.Random(0)
    fronts = backs = 0
    for _ in range(3000):
        la, lb, m = rng.randint(1, 300), rng.randint(1, 300), rng.randint(2, 200)
        fa, ba, fb, bb = truncation(la, lb, m, rng)
        ref = _truncate_loop(la, lb, m, rng)
        assert (fa + ba, fb + bb) == (ref[0] + ref[1], ref[2] + ref[3])
        assert min(fa, ba, fb, bb) >= 0 and la - fa - ba >= 1 and lb - fb - bb >= 1
        fronts, backs = fronts + fa + fb, backs + ba + bb
    assert abs(fronts / (fronts + backs) - 0.5) < 0.01


def test_balanced_pairs_are_exactly_half_is_next_and_keep_document_order():
    pairs = np.zeros((1000, PAIR_COLUMNS), dtype=np.int64)
    pairs[:, 0] = np.arange(1000)  # a_start: stands for document order
    pairs[:, NSP_LABEL] = np.where(np.arange(1000) % 3 == 0, IS_NEXT, NOT_NEXT)  # 334 IsNext, 666 NotNext
    balanced = balance_labels(pairs, random.Random(0))
    labels = balanced[:, NSP_LABEL]
    assert (labels == IS_NEXT).sum() == (labels == NOT_NEXT).sum() == 334
    assert (np.diff(balanced[:, 0]) > 0).all()  # order kept, no pair twice
    assert set(balanced[labels == IS_NEXT, 0]) == set(pairs[pairs[:, NSP_LABEL] == IS_NEXT, 0])  # minority kept whole
