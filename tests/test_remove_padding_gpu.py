"""bertserve.RemovePadding's CUDA kernels (custom_kernels/src/remove_padding_kernel.cu) against ONNX Runtime's
own com.microsoft.RemovePadding, both through real CUDA sessions: all four outputs equal on batches of
one row to more rows than the kernel's block has threads, empty rows and full ones, and widths whose
rows are and are not a multiple of 16 bytes. Needs the library built with nvcc (bash custom_kernels/build.sh)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from artifact.session import kernels_library, open_session
from custom_kernels.fusion import offers_remove_padding, remove_padding_model
from tests.padding_reference import ort_token_offset

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def library():
    found = kernels_library("on", "cuda")
    assert offers_remove_padding(found), f"{found} has no RemovePadding: build it where nvcc is found"
    return found


def _sessions(tmp_path, library):
    ours = remove_padding_model(TensorProto.FLOAT16)
    theirs = remove_padding_model(TensorProto.FLOAT16)
    theirs.graph.node[0].domain = "com.microsoft"
    theirs.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    for name, model in (("ours", ours), ("theirs", theirs)):
        onnx.save(model, str(tmp_path / f"{name}.onnx"))
    return (open_session(tmp_path / "ours.onnx", "cuda", library=library),
            open_session(tmp_path / "theirs.onnx", "cuda"))


@pytest.mark.parametrize("rows,width,hidden", [(1, 1, 8), (3, 17, 768), (256, 128, 768), (1500, 40, 8),
                                               (64, 512, 6), (5, 9, 1024)])
def test_our_remove_padding_gives_what_onnx_runtimes_gives(tmp_path, library, rows, width, hidden):
    rng = np.random.default_rng(rows * width)
    lengths = rng.integers(1, width + 1, rows)
    lengths[rng.integers(0, rows, max(1, rows // 10))] = width  # some rows full
    if rows > 2:
        lengths[1] = 0  # and an empty one
    ours, theirs = _sessions(tmp_path, library)
    feed = {"input": rng.standard_normal((rows, width, hidden)).astype(np.float16),
            "sequence_token_count": lengths.astype(np.int32)}
    got, want = ours.run(None, feed), theirs.run(None, feed)
    for name, a, b in zip(("output", "token_offset", "cumulative", "longest"), got, want):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        np.testing.assert_array_equal(a, b, err_msg=name)
    offset, cumulative = ort_token_offset(lengths.tolist(), width)
    assert got[1].ravel().tolist() == offset and got[2].tolist() == cumulative


def test_a_batch_of_other_sizes_after_a_large_one_is_sized_by_its_own_count(tmp_path, library):
    """The count that sizes the output comes back from the GPU every batch, never from the one before."""
    ours, _ = _sessions(tmp_path, library)
    rng = np.random.default_rng(3)
    for rows, width in ((300, 128), (2, 3), (40, 64)):
        lengths = rng.integers(0, width + 1, rows).astype(np.int32)
        x = rng.standard_normal((rows, width, 16)).astype(np.float16)
        out, *_ = ours.run(None, {"input": x, "sequence_token_count": lengths})
        assert out.shape == (int(lengths.sum()), 16)
        np.testing.assert_array_equal(out, x.reshape(-1, 16)[ort_token_offset(lengths.tolist(), width)[0][:lengths.sum()]])
