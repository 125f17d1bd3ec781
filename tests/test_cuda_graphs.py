"""Small batches in fixed-shape buckets (app/cuda_graphs.py). CUDA graph capture itself needs a GPU
(tests/test_export_gpu.py); the padding into buckets and the cutting back out are checked here on the
CPU provider with the tiny artifact's fp32 graph, against the same batch run as it is."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from app.cuda_graphs import CudaGraphBuckets, rows_up_to
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


@pytest.mark.parametrize("rows,length", [(1, 3), (1, 16), (2, 9), (3, 17), (5, 30), (8, 32)])
def test_a_batch_padded_into_a_bucket_gives_its_own_outputs(graph, rows, length):
    manifest, session = graph
    pad = manifest.special_tokens["[PAD]"]
    buckets = CudaGraphBuckets(session, "cpu", 0, manifest.max_length, pad, max_rows=8, lengths=(16, 32))
    assert buckets.fits(rows, length)
    ids, mask, types = batch(np.random.default_rng(rows * 100 + length), rows, length, manifest.vocab_size, pad)
    names = tuple(o.name for o in session.get_outputs())
    got = buckets.run(ids, mask, types, names)
    want = dict(zip(names, session.run(list(names), dict(zip(INPUT_NAMES, (ids, mask, types))))))
    for name in names:
        assert got[name].shape == want[name].shape, name
        real = mask.astype(bool) if got[name].ndim == 3 else slice(None)
        np.testing.assert_allclose(got[name][real], want[name][real], atol=2e-5, err_msg=name)


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
    assert not OrtEngine(tiny_artifact_dir, manifest, "cpu", "fp32", cuda_graphs="auto").cuda_graphs
    with pytest.raises(EngineError, match="padded twin"):
        OrtEngine(tiny_artifact_dir, manifest, "cpu", "fp32", cuda_graphs="on")
    with pytest.raises(EngineError, match="auto, on or off"):
        OrtEngine(tiny_artifact_dir, manifest, "cpu", "fp32", cuda_graphs="yes")
