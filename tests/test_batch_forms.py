"""A batch's two forms (app/engine.Batch): padded arrays and the real tokens one row after another, each
made from the other exactly, so that every graph gets the same texts whichever form the batcher made."""
from __future__ import annotations

import numpy as np

from app.batcher import Sequences, collate
from app.engine import Batch

PAD = 0


def rows(seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 30, 9).astype(np.int64)
    ids = rng.integers(5, 1000, int(lengths.sum())).astype(np.int64)
    type_ids = (rng.random(int(lengths.sum())) < 0.4).astype(np.int64)
    return ids, type_ids, lengths


def test_rows_padded_to_the_longest_with_pad_ids_and_a_mask():
    ids, type_ids, lengths = rows()
    batch = collate(Sequences(ids, type_ids, lengths), PAD, frozenset({"pooled_embedding", "cls_embedding"}))
    longest = int(lengths.max())
    assert batch.input_ids.shape == batch.attention_mask.shape == batch.token_type_ids.shape == (9, longest)
    assert batch.input_ids.dtype == batch.attention_mask.dtype == batch.token_type_ids.dtype == np.int64
    starts = np.r_[0, np.cumsum(lengths)[:-1]]
    for row, (start, n) in enumerate(zip(starts, lengths)):
        assert batch.input_ids[row, :n].tolist() == ids[start:start + n].tolist()
        assert batch.token_type_ids[row, :n].tolist() == type_ids[start:start + n].tolist()
        assert (batch.input_ids[row, n:] == PAD).all() and (batch.token_type_ids[row, n:] == 0).all()
        assert batch.attention_mask[row].tolist() == [1] * n + [0] * (longest - n)
    assert batch.outputs == ("cls_embedding", "pooled_embedding")  # sorted: one graph call for equal sets
    assert batch.padded_tokens == 9 * longest


def test_rows_come_back_unpadded_as_given_and_from_a_padded_batch():
    ids, type_ids, lengths = rows(1)
    made = Batch.of_rows(ids, type_ids, lengths, PAD, ("cls_embedding",))
    assert all(a is b for a, b in zip(made.unpadded(), (ids, type_ids, lengths)))  # no copy on the replay path
    padded = Batch(made.input_ids, made.attention_mask, made.token_type_ids, ("cls_embedding",))
    for got, want in zip(padded.unpadded(), (ids, type_ids, lengths)):
        assert got.tolist() == want.tolist()
    assert padded.padded_tokens == made.padded_tokens == len(lengths) * int(lengths.max())
