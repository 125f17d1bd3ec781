"""Masked-LM corruption, measured over thousands of served examples."""
from __future__ import annotations

import numpy as np
import pytest

from data_corpora import prepare, write_txt_corpus
from training.masking import IGNORE_INDEX, num_to_predict
from training.wordpiece import CLS, MASK, PAD, SEP, SPECIAL_TOKENS

MAX_SEQ_LEN = 64


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("masking")
    return tmp, write_txt_corpus(tmp / "c.txt", n_docs=3000, sentences=(3, 8), words=(3, 10))


def _served(tmp, corpus, **config):
    data = prepare(tmp, corpus, max_seq_len=MAX_SEQ_LEN, **config)
    batches = list(data.train.batches(epoch=0, batch_size=64, seed=3))
    assert sum(len(b["input_ids"]) for b in batches) >= 4000
    cat = {k: [b[k].numpy() for b in batches] for k in ("input_ids", "mlm_labels", "attention_mask")}
    rows = []  # (corrupted ids, labels, original ids) per example, padding removed
    for ids, labels, mask in zip(*(cat[k] for k in ("input_ids", "mlm_labels", "attention_mask"))):
        for r in range(len(ids)):
            n = int(mask[r].sum())
            original = np.where(labels[r, :n] == IGNORE_INDEX, ids[r, :n], labels[r, :n])
            rows.append((ids[r, :n], labels[r, :n], original))
    return data, rows


@pytest.fixture(scope="module")
def token_level(corpus):
    return _served(*corpus)


def test_each_sequence_gets_exactly_its_share_of_predictions(token_level):
    data, rows = token_level
    special = [data.tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    for _, labels, original in rows:
        n_real = int(np.sum(~np.isin(original, special)))
        expected = min(20, max(1, round(0.15 * n_real)))
        assert int(np.sum(labels != IGNORE_INDEX)) == expected == num_to_predict(n_real, 0.15, 20)


def test_the_cap_applies_to_long_sequences(tmp_path):
    long = write_txt_corpus(tmp_path / "c.txt", n_docs=60, sentences=(30, 40), words=(8, 12))
    data = prepare(tmp_path, long, max_seq_len=256, max_predictions_per_seq=20)
    batch = next(data.train.batches(0, 16, seed=0))
    counts = (batch["mlm_labels"] != IGNORE_INDEX).sum(1)
    real = batch["attention_mask"].sum(1) - 3
    assert (counts[real * 0.15 >= 20.5] == 20).all() and (real * 0.15 >= 20.5).any()


def test_80_10_10_split_and_random_tokens_are_never_special(token_level):
    data, rows = token_level
    mask_id = data.tokenizer.token_to_id(MASK)
    special = [data.tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    chosen = np.concatenate([labels != IGNORE_INDEX for _, labels, _ in rows])
    corrupted = np.concatenate([ids for ids, _, _ in rows])[chosen]
    original = np.concatenate([orig for _, _, orig in rows])[chosen]
    assert len(corrupted) > 20000
    masked = corrupted == mask_id
    kept = corrupted == original
    replaced = ~masked & ~kept
    vocab = data.tokenizer.get_vocab_size() - len(special)
    assert abs(masked.mean() - 0.8) < 0.02
    assert abs(kept.mean() - (0.1 + 0.1 / vocab)) < 0.015   # a random draw may hit the original
    assert abs(replaced.mean() - 0.1 * (1 - 1 / vocab)) < 0.015
    assert not np.isin(corrupted[replaced], special).any()
    assert len(np.unique(corrupted[replaced])) > 0.5 * vocab  # drawn from the whole vocabulary


def test_special_tokens_are_never_chosen_and_mask_only_where_predicted(token_level):
    data, rows = token_level
    ids_of = data.tokenizer.token_to_id
    for ids, labels, original in rows:
        specials = np.isin(original, [ids_of(CLS), ids_of(SEP), ids_of(PAD)])
        assert (labels[specials] == IGNORE_INDEX).all()
        assert (ids[specials] == original[specials]).all()
        assert original[0] == ids_of(CLS) and original[-1] == ids_of(SEP)
        assert not (ids[labels == IGNORE_INDEX] == ids_of(MASK)).any()


def _word_ids(original: np.ndarray, continuation: np.ndarray, special: np.ndarray) -> np.ndarray:
    """Word number of each position (a token and the "##" pieces after it), -1 on special tokens."""
    real = ~special[original]
    after_real = np.concatenate([[False], real[:-1]])
    starts = real & ~(continuation[original] & after_real)
    return np.where(real, np.cumsum(starts) - 1, -1)


def test_whole_word_masking_masks_whole_words(corpus):
    data, rows = _served(*corpus, whole_word_masking=True)
    masker = data.train.masker
    multi_piece = total = 0
    for _, labels, original in rows:
        chosen = labels != IGNORE_INDEX
        n_real = int(np.sum(~masker.is_special[original]))
        budget = min(20, max(1, round(0.15 * n_real)))
        assert chosen.sum() <= budget
        total += chosen.sum() / budget
        words = _word_ids(original, masker.is_continuation, masker.is_special)
        size = np.bincount(words[words >= 0])
        masked = np.bincount(words[chosen], minlength=len(size))
        assert ((masked == 0) | (masked == size)).all(), "a word was masked in part"
        multi_piece += int(np.sum((size > 1) & (masked == size)))
    assert total / len(rows) > 0.9   # the budget is (nearly) used up
    assert multi_piece > 500          # and many masked words are several pieces long
