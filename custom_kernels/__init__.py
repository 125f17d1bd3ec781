"""Our own ONNX Runtime operators for the CUDA provider, and where their library is.

ONNX Runtime's CUDA provider runs a BERT feed-forward block as a MatMul and then a separate BiasGelu
kernel that reads the whole [tokens, 4·hidden] product back from memory. `libbertserve_ops.so`
(src/matmul_epilogues.cc, built by build.sh) does both in one cuBLASLt GEMM whose epilogue adds the
bias and applies GELU (MatMulBiasGelu); MatMulBias adds the attention's bias to its Q, K and V
products the same way, and where build.sh finds nvcc, PackedAttention (src/packed_attention_kernel.cu)
runs the packed graph's attention in place of ORT's PackedMultiHeadAttention and RemovePadding
(src/remove_padding_kernel.cu) its padding's removal in place of ORT's. `python -m export --device
cuda` writes a second fp16 graph that uses them (fusion.py) and gates it on parity like every graph; the
server runs that graph when it can load the library. This module imports nothing but the standard
library: the server uses it.
"""
from __future__ import annotations

import os
from pathlib import Path

DOMAIN = "bertserve"
LIBRARY_ENV = "BERTSERVE_KERNELS_LIBRARY"
LIBRARY_FILE = "libbertserve_ops.so"
_BUILT_HERE = Path(__file__).resolve().parent / "build" / LIBRARY_FILE  # bash custom_kernels/build.sh


CHOICES = ("auto", "on", "off")  # export's --custom-kernels and the server's custom_kernels setting


class KernelsUnavailable(RuntimeError):
    """Custom kernels were required, or their library named, and it is not there."""


def find_library() -> Path | None:
    """$BERTSERVE_KERNELS_LIBRARY when set (it must exist), else a library built in this checkout, else None."""
    named = os.environ.get(LIBRARY_ENV)
    if named:
        if not Path(named).is_file():
            raise KernelsUnavailable(f"{LIBRARY_ENV}={named} does not exist; build it with "
                                     f"`bash custom_kernels/build.sh` or unset {LIBRARY_ENV}")
        return Path(named)
    return _BUILT_HERE if _BUILT_HERE.is_file() else None


def library_for(choice: str) -> Path | None:
    """The library to use under `choice`: "off" none, "auto" the one found if any, "on" the one found or
    KernelsUnavailable."""
    if choice not in CHOICES:
        raise ValueError(f"custom kernels must be one of {', '.join(CHOICES)}, not {choice!r}")
    if choice == "off":
        return None
    library = find_library()
    if library is None and choice == "on":
        raise KernelsUnavailable(f"custom kernels are on, but {LIBRARY_FILE} was not found: build it "
                                 f"(bash custom_kernels/build.sh) or name it in ${LIBRARY_ENV}")
    return library
