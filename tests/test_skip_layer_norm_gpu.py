"""bertserve.MatMulSkipLayerNorm on the GPU (custom_kernels/src/matmul_epilogues.cc and layer_norm_kernel.cu)
against LayerNorm(X·W + bias + skip) in float64, through a real ONNX Runtime CUDA session: widths from
one 16-byte piece a lane to the kernel's largest, BERT's odd 312, a batch past the autotuning threshold,
and a width the kernel does not take. Needs the library built with nvcc (bash custom_kernels/build.sh)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from artifact.session import kernels_library, open_session
from custom_kernels.fusion import matmul_skip_layer_norm_model, offers_skip_layer_norm

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def library():
    found = kernels_library("on", "cuda")
    assert offers_skip_layer_norm(found), f"{found} has no MatMulSkipLayerNorm: build it where nvcc is found"
    return found


def _session(tmp_path, library, epsilon: float = 1e-12):
    path = tmp_path / "matmul_skip_layer_norm.onnx"
    onnx.save(matmul_skip_layer_norm_model(epsilon=epsilon), str(path))
    return open_session(path, "cuda", library=library)


def _feed(rng, rows: int, k: int, n: int) -> dict[str, np.ndarray]:
    feed = {"x": rng.normal(0, 1, (rows, k)), "w": rng.normal(0, k ** -0.5, (k, n)), "bias": rng.normal(0, 1, n),
            "skip": rng.normal(2, 3, (rows, n)), "gamma": rng.normal(1, 0.5, n), "beta": rng.normal(0, 1, n)}
    return {name: value.astype(np.float16) for name, value in feed.items()}


def _reference(feed: dict[str, np.ndarray], epsilon: float) -> np.ndarray:
    f = {name: value.astype(np.float64) for name, value in feed.items()}
    z = f["x"] @ f["w"] + f["bias"] + f["skip"]
    mean = z.mean(-1, keepdims=True)
    return (z - mean) / np.sqrt(((z - mean) ** 2).mean(-1, keepdims=True) + epsilon) * f["gamma"] + f["beta"]


@pytest.mark.parametrize("rows,k,n", [(1, 64, 8), (5, 128, 128), (37, 312, 312), (300, 768, 768),
                                      (5000, 768, 768), (64, 3072, 768), (17, 1024, 1024), (9, 256, 2048)])
def test_operator_matches_layer_norm_of_product_bias_and_skip(tmp_path, library, rows, k, n):
    rng = np.random.default_rng(rows + n)
    feed = _feed(rng, rows, k, n)
    (got,) = _session(tmp_path, library).run(None, feed)
    want = _reference(feed, 1e-12)
    assert got.dtype == np.float16 and np.isfinite(got).all()
    np.testing.assert_allclose(got.astype(np.float64), want, atol=3e-2, rtol=0)
    g = got.astype(np.float64)
    cosine = (g * want).sum(-1) / (np.linalg.norm(g, axis=-1) * np.linalg.norm(want, axis=-1))
    assert cosine.min() >= 0.9999


def test_epsilon_is_the_nodes(tmp_path, library):
    """A row of equal values normalises to beta, and epsilon decides by how much the rest is shrunk."""
    rng = np.random.default_rng(0)
    feed = _feed(rng, 4, 64, 128)
    (got,) = _session(tmp_path, library, epsilon=4.0).run(None, feed)
    np.testing.assert_allclose(got.astype(np.float64), _reference(feed, 4.0), atol=3e-2, rtol=0)


def test_a_width_the_kernel_does_not_take_fails_in_one_line_and_the_session_keeps_working(tmp_path, library):
    session = _session(tmp_path, library)
    rng = np.random.default_rng(1)
    with pytest.raises(Exception, match="multiple of 8 up to 2048, not 12"):
        session.run(None, _feed(rng, 3, 16, 12))
    feed = _feed(rng, 3, 16, 16)
    (got,) = session.run(None, feed)
    np.testing.assert_allclose(got.astype(np.float64), _reference(feed, 1e-12), atol=3e-2, rtol=0)
