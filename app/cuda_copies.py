"""Copies between the host and a replayed CUDA graph's buffers, made without Python's interpreter lock.

ONNX Runtime's `OrtValue.update_inplace` and `OrtValue.numpy()` copy while the calling thread holds the
lock. On the replaying thread every µs it holds the lock is a µs the engine process's event loop cannot
answer a batch or read requests: one input copy instead of four gained 5% at one text per request,
several times the thread time it saved (BENCHMARKS.md). ctypes lets go of the lock for the length of a
foreign call, so these copies call the CUDA runtime's `cudaMemcpy` (libcudart, already loaded with
onnxruntime's CUDA provider) on the buffers' device pointers. The output copy also takes only the
batch's rows, not the whole bucket's.
"""
from __future__ import annotations

import ctypes
import logging

import numpy as np

log = logging.getLogger("app.cuda_copies")
_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)
# The CUDA runtimes onnxruntime-gpu is built against; a library already loaded is found by its soname
_LIBRARIES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")


class CudaCopies:
    """cudaMemcpy through ctypes. Errors raise RuntimeError worded as ONNX Runtime words CUDA's ("CUDA
    failure N: ..."), so that a sticky one is told apart as ORT's would be (app.engine.device_lost)."""

    def __init__(self, library: ctypes.CDLL):
        self._memcpy = library.cudaMemcpy
        self._memcpy.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        self._memcpy.restype = ctypes.c_int
        self._synchronize = library.cudaStreamSynchronize
        self._synchronize.argtypes = (ctypes.c_void_p,)
        self._synchronize.restype = ctypes.c_int
        self._error_string = library.cudaGetErrorString
        self._error_string.argtypes = (ctypes.c_int,)
        self._error_string.restype = ctypes.c_char_p
        self._set_device = library.cudaSetDevice
        self._set_device.argtypes = (ctypes.c_int,)
        self._set_device.restype = ctypes.c_int

    @classmethod
    def load(cls) -> CudaCopies | None:
        """The copies through the CUDA runtime this process has loaded (or can load); None without one, and
        then the callers copy through ONNX Runtime."""
        for name in _LIBRARIES:
            try:
                return cls(ctypes.CDLL(name))
            except (OSError, AttributeError):
                continue
        log.info("no CUDA runtime library (%s) to copy through; replays copy through ONNX Runtime",
                 ", ".join(_LIBRARIES))
        return None

    def use_device(self, device_id: int) -> None:
        """On the thread that will copy: the GPU whose legacy stream `to_device` synchronises."""
        self._check(self._set_device(device_id))

    def to_device(self, device_pointer: int, host: np.ndarray) -> None:
        """`host` (C-contiguous) to the device memory at `device_pointer`, landed when this returns: the
        copy from pageable memory may still be under way when cudaMemcpy returns, and the replay reads it
        on ONNX Runtime's own non-blocking stream, so the legacy stream is synchronised after it."""
        self._check(self._memcpy(device_pointer, host.ctypes.data, host.nbytes, _DEFAULT))
        self._check(self._synchronize(None))

    def to_host(self, device_pointer: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A new host array of `shape` and `dtype` from the device memory at `device_pointer`."""
        out = np.empty(shape, dtype)
        self._check(self._memcpy(out.ctypes.data, device_pointer, out.nbytes, _DEFAULT))
        return out

    def _check(self, code: int) -> None:
        if code:
            raise RuntimeError(f"CUDA failure {code}: {self._error_string(code).decode(errors='replace')}")
