"""bertserve.PackedAttention's CUDA kernel (custom_kernels/src/packed_attention_kernel.cu) against softmax
attention computed per sequence in float64, through a real ONNX Runtime CUDA session: lengths on both
sides of its 64-row tiles and 128-key copy rounds, both head sizes it is built for, and a token_offset
narrower than the longest sequence. Needs the library built with nvcc (bash custom_kernels/build.sh)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from artifact.session import kernels_library, open_session
from custom_kernels.fusion import offers_packed_attention, packed_attention_model
from tests.attention_reference import softmax_attention

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def library():
    found = kernels_library("on", "cuda")
    assert offers_packed_attention(found, 64), f"{found} has no PackedAttention: build it where nvcc is found"
    return found


def _session(tmp_path, library, heads: int, size: int):
    path = tmp_path / f"attention_{heads}x{size}.onnx"
    onnx.save(packed_attention_model(heads, size), str(path))
    return open_session(path, "cuda", library=library)


@pytest.mark.parametrize("heads,size", [(12, 64), (12, 32), (4, 64)])
@pytest.mark.parametrize("lengths", [[1], [63, 64, 65, 1], [127, 128, 129], [300, 5, 512, 40], "random"])
def test_kernel_matches_softmax_attention_per_sequence(tmp_path, library, heads, size, lengths):
    rng = np.random.default_rng(len(str(lengths)) + size)
    if lengths == "random":
        lengths = rng.integers(1, 200, 48).tolist()
    session = _session(tmp_path, library, heads, size)
    q, k, v = (rng.normal(0, 2, (sum(lengths), heads * size)).astype(np.float16) for _ in range(3))
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    (got,) = session.run(None, {"q": q, "k": k, "v": v, "cu": cu,
                                "token_offset": np.zeros((len(lengths), max(lengths)), np.int32)})
    want = softmax_attention(q, k, v, lengths, heads)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got.astype(np.float64), want, atol=1e-2, rtol=0)
    per_head = lambda x: x.reshape(len(x), heads, size)  # noqa: E731
    g, w = per_head(got.astype(np.float64)), per_head(want)
    cosine = (g * w).sum(-1) / (np.linalg.norm(g, axis=-1) * np.linalg.norm(w, axis=-1))
    assert cosine.min() >= 0.9999


def test_sequences_longer_than_token_offset_says_are_still_attended_in_full(tmp_path, library):
    """The grid is sized from token_offset's width; the kernel walks any rows past it itself."""
    rng = np.random.default_rng(1)
    lengths, heads, size = [200, 70], 12, 64
    session = _session(tmp_path, library, heads, size)
    q, k, v = (rng.normal(0, 1, (sum(lengths), heads * size)).astype(np.float16) for _ in range(3))
    cu = np.array([0, 200, 270], np.int32)
    (got,) = session.run(None, {"q": q, "k": k, "v": v, "cu": cu, "token_offset": np.zeros((2, 16), np.int32)})
    np.testing.assert_allclose(got.astype(np.float64), softmax_attention(q, k, v, lengths, heads), atol=1e-2, rtol=0)


def test_a_head_size_the_kernel_lacks_keeps_the_session_from_opening(tmp_path, library):
    """Export's probe asks at the model's head size; 128 is not built, so the graph keeps ORT's attention."""
    assert offers_packed_attention(library, 128) is False


@pytest.mark.parametrize("heads,size", [(12, 64), (12, 32)])
@pytest.mark.parametrize("lengths", [[1], [127, 128, 129], "random"])
def test_qkv_kernel_reads_the_thirds_of_one_product(tmp_path, library, heads, size, lengths):
    """PackedQKVAttention: the same kernel over [Q | K | V] rows (a row stride of three widths) answers
    what PackedAttention answers over Q, K and V apart, to the bit."""
    from onnx import TensorProto, helper

    rng = np.random.default_rng(len(str(lengths)) + 7 * size)
    if lengths == "random":
        lengths = rng.integers(1, 200, 48).tolist()
    width = heads * size
    node = helper.make_node("PackedQKVAttention", ["qkv", "token_offset", "cu"], ["out"], domain="bertserve",
                            num_heads=heads, head_size=size, scale=size ** -0.5)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("qkv", TensorProto.FLOAT16, ["T", 3 * width]),
                                            helper.make_tensor_value_info("token_offset", TensorProto.INT32, ["B", "S"]),
                                            helper.make_tensor_value_info("cu", TensorProto.INT32, ["B1"])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT16, ["T", width])])
    path = tmp_path / "qkv.onnx"
    onnx.save(helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17),
                                                                    helper.make_opsetid("bertserve", 1)]), str(path))
    q, k, v = (rng.normal(0, 2, (sum(lengths), width)).astype(np.float16) for _ in range(3))
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    offsets = np.zeros((len(lengths), max(lengths)), np.int32)
    (got,) = open_session(path, "cuda", library=library).run(
        None, {"qkv": np.concatenate([q, k, v], axis=1), "token_offset": offsets, "cu": cu})
    (apart,) = _session(tmp_path, library, heads, size).run(None, {"q": q, "k": k, "v": v, "cu": cu,
                                                                   "token_offset": offsets})
    np.testing.assert_array_equal(got, apart)
    np.testing.assert_allclose(got.astype(np.float64), softmax_attention(q, k, v, lengths, heads), atol=1e-2, rtol=0)
