"""app/cuda_copies.py against the real CUDA runtime library where one is installed: without a usable GPU
(as here and in CI) every copy fails, and says so as ONNX Runtime words a CUDA error, which the engine
reads to tell a lost device from a passing failure. The copies themselves are checked on a GPU by the
replay tests (tests/test_export_gpu.py: replayed outputs against the packed graph's)."""
from __future__ import annotations

import numpy as np
import pytest

from app.cuda_copies import CudaCopies
from app.engine import _CUDA_FAILURE, STICKY_CUDA_ERRORS, device_lost


def test_a_failed_copy_is_reported_as_a_cuda_failure():
    copies = CudaCopies.load()
    if copies is None:
        pytest.skip("no CUDA runtime library on this machine")
    try:
        copies.use_device(0)
        copies.to_host(0, (2, 3), np.float32)  # a null device pointer fails on any machine
    except RuntimeError as e:
        found = _CUDA_FAILURE.search(str(e))
        assert found is not None and int(found.group(1)) > 0, e
        assert (device_lost(e) is not None) == (int(found.group(1)) in STICKY_CUDA_ERRORS), e
    else:
        pytest.fail("a copy from a null device pointer succeeded")
