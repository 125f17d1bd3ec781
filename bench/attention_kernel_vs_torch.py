"""Our attention kernel (custom_kernels/src/packed_attention_kernel.cu) on its own, against PyTorch's
attention backends (FlashAttention, cuDNN, memory-efficient) on the same dense batches: for working on
the kernel, where bench/packed_attention_kernel.py compares it with ONNX Runtime's inside sessions.

    python bench/attention_kernel_vs_torch.py [--json OUT.json]

Needs nvcc and torch with CUDA. It compiles the kernel with a small C entry point into a temporary
library (printing ptxas' registers and spills per instantiation), checks it against softmax attention in
float32 per sequence (lengths around its 64-row tiles and 128-key rounds, head sizes 32 and 64), then
times one layer (12 heads of 64) per batch: CUDA events over 200 launches, best of three, output
preallocated. Dense batches are [B, L] with every sequence L long; ragged ones only run ours.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
KERNEL = ROOT / "custom_kernels" / "src" / "packed_attention_kernel.cu"
ENTRY = """#include "packed_attention.h"
extern "C" int attention(const void* q, const void* k, const void* v, void* o, const int* cu, int batch,
                         int max_len, int heads, int head_size, float scale, void* stream) {
  PackedAttentionArgs a{q, k, v, o, cu, batch, max_len, heads, head_size, scale};
  return (int)packed_attention_launch(a, (cudaStream_t)stream);
}
"""


def build(work: Path) -> ctypes.CDLL:
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    entry = work / "entry.cu"
    entry.write_text(ENTRY)
    out = work / "attention.so"
    cmd = [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", f"-I{KERNEL.parent}", "--resource-usage",
           "-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90", str(entry), str(KERNEL),
           "-o", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    print("\n".join(line for line in done.stderr.splitlines() if "registers" in line or "spill" in line
                    or "error" in line))
    if done.returncode:
        raise SystemExit(f"nvcc failed ({done.returncode})")
    lib = ctypes.CDLL(str(out))
    lib.attention.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 4 + [ctypes.c_float, ctypes.c_void_p]
    return lib


def ours(lib, q, k, v, cu, heads, size, max_len, out):
    rc = lib.attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), cu.data_ptr(), cu.numel() - 1,
                       max_len, heads, size, 1 / math.sqrt(size), torch.cuda.current_stream().cuda_stream)
    if rc:
        raise RuntimeError(f"launch failed: cudaError {rc}")
    return out


def packed(lengths: list[int], heads: int, size: int, scale: float = 1.0):
    q, k, v = (torch.randn(sum(lengths), heads * size, device="cuda", dtype=torch.half) * scale for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    return q, k, v, cu


def reference(q, k, v, lengths, heads, size):
    out, start = [], 0
    for n in lengths:
        per_head = lambda x: x[start:start + n].float().view(n, heads, size).transpose(0, 1)  # noqa: E731
        attended = torch.softmax(per_head(q) @ per_head(k).transpose(1, 2) / math.sqrt(size), -1) @ per_head(v)
        out.append(attended.transpose(0, 1).reshape(n, heads * size))
        start += n
    return torch.cat(out)


def microseconds(fn, launches: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start, end, best = torch.cuda.Event(True), torch.cuda.Event(True), float("inf")
    for _ in range(3):
        start.record()
        for _ in range(launches):
            fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / launches)
    return best * 1000


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(Path(tmp))
        checks = []
        for heads, size in ((12, 64), (12, 32)):
            for lengths in ([1], [5, 64, 3, 40], [5, 64, 65, 128, 3], [300, 17, 129], [512, 1, 200],
                            torch.randint(1, 200, (37,)).tolist()):
                q, k, v, cu = packed(lengths, heads, size, scale=2.0)
                got = ours(lib, q, k, v, cu, heads, size, max(lengths), torch.full_like(q, float("nan")))
                want = reference(q, k, v, lengths, heads, size)
                checks.append({"heads": heads, "head_size": size, "lengths": lengths[:8],
                               "max_abs_diff": (got.float() - want).abs().max().item(),
                               "min_cosine": F.cosine_similarity(got.float(), want, dim=-1).min().item()})
                print(f"check H={heads} D={size} lengths={lengths[:6]}: max |diff| {checks[-1]['max_abs_diff']:.2e}, "
                      f"min cos {checks[-1]['min_cosine']:.6f}")
                if not (checks[-1]["min_cosine"] >= 0.9999 and checks[-1]["max_abs_diff"] < 1e-2):
                    raise SystemExit("the kernel's output differs from softmax attention")

        rows, heads, size = [], 12, 64
        workloads = {"256 x 128": [128] * 256, "32 x 128": [128] * 32, "256 x 64": [64] * 256,
                     "128 x 48": [48] * 128, "128 ragged 16-256": torch.randint(16, 257, (128,)).tolist()}
        for label, lengths in workloads.items():
            q, k, v, cu = packed(lengths, heads, size)
            out = torch.empty_like(q)
            row = {"workload": label, "ours_us": microseconds(
                lambda: ours(lib, q, k, v, cu, heads, size, max(lengths), out))}
            if len(set(lengths)) == 1:
                b, n = len(lengths), lengths[0]
                qd, kd, vd = (x.view(b, n, heads, size).transpose(1, 2) for x in (q, k, v))
                for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
                    try:
                        with sdpa_kernel(backend):
                            row[f"torch_{backend.name.lower()}_us"] = microseconds(
                                lambda: F.scaled_dot_product_attention(qd, kd, vd))
                    except RuntimeError as e:  # a backend this build or card lacks
                        row[f"torch_{backend.name.lower()}_us"] = None
                        print(f"{backend.name}: {e}".splitlines()[0])
            rows.append(row)
            print(f"{label:>20}: " + ", ".join(f"{k.removesuffix('_us')} {v:.1f} us" for k, v in row.items()
                                                 if k.endswith("_us") and v is not None))
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "checks": checks, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
