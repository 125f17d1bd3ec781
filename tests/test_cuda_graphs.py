"""Small batches in fixed-shape buckets (app/cuda_graphs.py). CUDA graph capture itself needs a GPU
(tests/test_export_gpu.py); the padding into buckets and the cutting back out are checked here on the
CPU provider with the tiny artifact's fp32 graph, against the same batch run as it is."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from app.cuda_graphs import CudaGraphBuckets, ReplayPlanner, rows_up_to
from app.engine import EngineError, OrtEngine
from artifact.manifest import INPUT_NAMES, read_manifest


@pytest.fixture(scope="module")
def graph(tiny_artifact_dir):
    manifest = read_manifest(tiny_artifact_dir)
    session = ort.InferenceSession(str(tiny_artifact_dir / manifest.graph("fp32").file),
                                   providers=["CPUExecutionProvider"])
    return manifest, session


def batch(rng, rows: int, length: int, vocab: int, pad: int):
    lengths = rng.integers(2, length + 1, rows)
    lengths[0] = length  # the longest sets the batch's width, as collate does
    real = np.arange(length) < lengths[:, None]
    ids = np.where(real, rng.integers(5, vocab, (rows, length)), pad)
    types = np.where(real & (np.arange(length) >= lengths[:, None] // 2), 1, 0)
    return ids.astype(np.int64), real.astype(np.int64), types.astype(np.int64)


def assert_replayed_as_run(buckets, session, ids, mask, types):
    """Every output of the batch through the buckets, on its real tokens, as the session gives it."""
    names = tuple(o.name for o in session.get_outputs())
    got = buckets.run(ids, mask, types, names)
    want = dict(zip(names, session.run(list(names), dict(zip(INPUT_NAMES, (ids, mask, types))))))
    for name in names:
        assert got[name].shape == want[name].shape, name
        real = mask.astype(bool) if got[name].ndim == 3 else slice(None)
        np.testing.assert_allclose(got[name][real], want[name][real], atol=2e-5, err_msg=name)


@pytest.mark.parametrize("rows,length", [(1, 3), (1, 16), (2, 9), (3, 17), (5, 30), (8, 32)])
def test_a_batch_padded_into_a_bucket_gives_its_own_outputs(graph, rows, length):
    manifest, session = graph
    pad = manifest.special_tokens["[PAD]"]
    buckets = CudaGraphBuckets(session, "cpu", 0, manifest.max_length, pad, max_rows=8, lengths=(16, 32))
    assert buckets.fits(rows, length)
    ids, mask, types = batch(np.random.default_rng(rows * 100 + length), rows, length, manifest.vocab_size, pad)
    assert_replayed_as_run(buckets, session, ids, mask, types)


def test_a_batch_of_mixed_lengths_is_replayed_in_several_buckets_and_put_back_in_order(graph):
    manifest, session = graph
    pad = manifest.special_tokens["[PAD]"]
    buckets = CudaGraphBuckets(session, "cpu", 0, manifest.max_length, pad, max_rows=8, lengths=(8, 16, 32),
                               replay_cost_tokens=4)
    ids, mask, types = batch(np.random.default_rng(7), 7, 30, manifest.vocab_size, pad)
    mask[1:4, 6:] = ids[1:4, 6:] = 0  # three short rows among long ones, not next to each other
    mask[5, 6:] = ids[5, 6:] = 0
    ids[mask == 0] = pad
    plan = buckets.planner.plan(mask.sum(1))
    assert {bucket for _, _, bucket in plan} == {8, 32}
    assert_replayed_as_run(buckets, session, ids, mask, types)


@pytest.mark.parametrize("replay_cost", [0, 256, 10**9])
def test_a_replay_plan_covers_every_row_once_within_its_buckets_and_pads_no_more_than_one_bucket(replay_cost):
    rows, lengths = rows_up_to(64), (16, 32, 64, 128)
    planner = ReplayPlanner(rows, lengths, replay_cost)
    rng = np.random.default_rng(replay_cost)
    for n in list(range(1, 65)) * 3:
        real = np.clip(rng.lognormal(3.3, 0.7, n).astype(int), 2, 128)
        plan = planner.plan(real)
        taken = np.concatenate([t for t, _, _ in plan])
        assert sorted(taken.tolist()) == list(range(n))
        for t, bucket_rows, bucket_length in plan:
            assert 0 < len(t) <= bucket_rows and bucket_rows in rows and bucket_length in lengths
            assert real[t].max() <= bucket_length
        one_bucket = next(r for r in rows if r >= n) * next(L for L in lengths if L >= real.max())
        assert sum(r * L + replay_cost for _, r, L in plan) <= one_bucket + replay_cost
    if replay_cost == 10**9:  # replays so dear that the whole batch goes into one bucket
        assert len(plan) == 1


def test_a_batch_run_on_the_buckets_own_thread_replays_there(graph):
    """The batcher hands an idle small batch straight to the buckets' thread: `run` from there must replay
    in place (a hop to its own one-thread pool would wait on itself forever)."""
    manifest, session = graph
    pad = manifest.special_tokens["[PAD]"]
    buckets = CudaGraphBuckets(session, "cpu", 0, manifest.max_length, pad, max_rows=4, lengths=(16,))
    ids, mask, types = batch(np.random.default_rng(3), 3, 12, manifest.vocab_size, pad)
    names = tuple(o.name for o in session.get_outputs())
    on_thread = buckets.thread.submit(buckets.run, ids, mask, types, names).result(timeout=30)
    elsewhere = buckets.run(ids, mask, types, names)
    for name in names:
        np.testing.assert_array_equal(on_thread[name], elsewhere[name])


def test_only_batches_within_the_largest_bucket_fit(graph):
    manifest, session = graph
    buckets = CudaGraphBuckets(session, "cpu", 0, manifest.max_length, manifest.special_tokens["[PAD]"],
                               max_rows=4, lengths=(16, 32, 4096))
    assert buckets.lengths[-1] == manifest.max_length  # no bucket longer than the model takes
    assert buckets.fits(4, manifest.max_length) and not buckets.fits(5, 8)
    assert not buckets.fits(1, manifest.max_length + 1)


def test_the_captured_batch_sizes_are_powers_of_two_up_to_the_largest():
    assert rows_up_to(16) == (1, 2, 4, 8, 16) and rows_up_to(1) == (1,)
    assert rows_up_to(48) == (1, 2, 4, 8, 16, 32, 48)
    with pytest.raises(ValueError, match="at least 1 row"):
        rows_up_to(0)


def test_cuda_graphs_need_cuda_and_a_padded_twin(tiny_artifact_dir):
    manifest = read_manifest(tiny_artifact_dir)
    engine = OrtEngine(tiny_artifact_dir, manifest, "cpu", "fp32", cuda_graphs="auto")
    assert not engine.cuda_graphs and engine.replay_thread(1, 8) is None  # every batch on the batcher's threads
    with pytest.raises(EngineError, match="padded twin"):
        OrtEngine(tiny_artifact_dir, manifest, "cpu", "fp32", cuda_graphs="on")
    with pytest.raises(EngineError, match="auto, on or off"):
        OrtEngine(tiny_artifact_dir, manifest, "cpu", "fp32", cuda_graphs="yes")
