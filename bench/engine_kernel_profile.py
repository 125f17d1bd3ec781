"""GPU kernel time by kind (matrix products, GELU, attention, LayerNorm, ...) for one batch of b x L on
PyTorch fp16 SDPA and the ORT fp16 graphs: padded, packed on PackedAttention, packed on
PackedMultiHeadAttention, each also on custom_kernels' operator when its library is built (BERT-base
shape, random weights, built as bench/engine_throughput.py builds them). torch.profiler's CUPTI trace
sees every kernel of the process, ORT's included; ORT's own node profile times launches on the host,
not the GPU. Beside it, each engine's wall time per batch, back to back and one at a time: where the wall
time is well above the kernel time, the batch is bound by launches on the host, not by the GPU.

  python bench/engine_kernel_profile.py 256        # GPU machine, with onnxruntime-gpu; L = 128
  python bench/engine_kernel_profile.py 48 48      # a batch the server forms from one-text requests
  python bench/engine_kernel_profile.py 48 32 --artifact ART   # the graphs an exported artifact serves

With --artifact, the graphs profiled are that artifact's (`python -m export --device cuda`): the fp16 graph
the server runs (our kernels' variant when built) and its padded twin replayed as a CUDA graph; and the
served graph is also timed from two threads at once, as the server's two inference workers run it.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import numpy as np  # noqa: E402
import torch  # noqa: E402

from artifact.manifest import read_manifest  # noqa: E402
from artifact.session import kernels_library  # noqa: E402
from bench.cuda_graph_replays import two_threads_ms  # noqa: E402
from bench.engine_throughput import (PACKED_KINDS, VOCAB_SIZE, DeviceBoundSession, TorchEngine, build,  # noqa: E402
                                     fixed_batch, stdlib_docstrings)

# First match wins: attention and LayerNorm kernels before the generic product names.
KINDS = [("attention", r"fmha|flash|attention|Attention|softmax"),
         ("layernorm", r"[Ll]ayer_?[Nn]orm|LayerNormalization"),
         ("gelu", r"[Gg]elu"),
         ("gemm", r"gemm|Gemm|xmma|cutlass|sm90|sm80|ampere|hopper|cublas|nvjet|Kernel2"),
         ("cast/copy", r"[Cc]ast|copy|Copy|transpose|Transpose|elementwise|Memcpy")]
RUNS = 10


def kind(kernel: str) -> str:
    return next((k for k, pattern in KINDS if re.search(pattern, kernel)), "other")


def kernel_times(engine, feed) -> tuple[collections.Counter, collections.Counter, collections.Counter]:
    """Microseconds over RUNS runs: of GPU time by kind and by kernel name, and of the GPU idle before each
    kernel (from the end of the one before it), by that kernel's name."""
    prepared = engine.prepare(feed)
    for _ in range(5):
        engine.run(prepared)
    engine.sync()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(RUNS):
            engine.run(prepared)
        engine.sync()
        torch.cuda.synchronize()
    by_kind, by_name, idle_before = collections.Counter(), collections.Counter(), collections.Counter()
    spans = []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            us = getattr(event, "device_time_total", None) or event.cuda_time_total
            by_kind[kind(event.name)] += us
            by_name[event.name[:90]] += us
            spans.append((event.time_range.start, event.time_range.end, event.name[:90]))
    spans.sort()
    for (_, end, _), (start, _, name) in zip(spans, spans[1:]):
        idle_before[name] += max(0, start - end)
    return by_kind, by_name, idle_before


def wall_ms(engine, feed, runs: int = 50) -> tuple[float, float]:
    """Milliseconds per batch: `runs` launched back to back, then each waited for in turn."""
    prepared = engine.prepare(feed)
    engine.run(prepared)
    engine.sync()
    started = time.perf_counter()
    for _ in range(runs):
        engine.run(prepared)
    engine.sync()
    back_to_back = (time.perf_counter() - started) / runs * 1000
    started = time.perf_counter()
    for _ in range(runs):
        engine.run(prepared)
        engine.sync()
    return back_to_back, (time.perf_counter() - started) / runs * 1000


def two_threads_batch_ms(engine, feed, runs: int = 50) -> float:
    """Milliseconds per batch with two threads each running `runs` batches, each waited for, at once."""
    prepared = [engine.prepare(feed), engine.prepare(feed)]  # one binding per thread

    def run(thread: int, _: int) -> None:
        engine.run(prepared[thread])
        engine.sync()
    return two_threads_ms(run, runs)


def artifact_engines(folder: Path) -> dict:
    manifest = read_manifest(folder)
    graph, library = manifest.graph("fp16"), kernels_library("auto", "cuda")
    served = graph.custom_kernels if graph.custom_kernels and library else graph
    engines = {f"served {served.file}": DeviceBoundSession(folder / served.file, "cuda", kernels_library=library)}
    if graph.padded is not None:
        twin = graph.padded.custom_kernels if graph.padded.custom_kernels and library else graph.padded
        engines[f"padded twin {twin.file}, CUDA graph"] = DeviceBoundSession(folder / twin.file, "cuda", cuda_graph=True,
                                                                             kernels_library=library)
    return engines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("batch", type=int, nargs="?", default=256)
    parser.add_argument("length", type=int, nargs="?", default=128)
    parser.add_argument("--artifact", type=Path, help="profile this artifact's graphs instead of building models")
    parser.add_argument("--graph", type=Path, action="append", default=[],
                        help="with --artifact: also this graph file (with our kernels' library); repeatable")
    args = parser.parse_args()
    batch, length = args.batch, args.length
    if args.artifact:
        engines = artifact_engines(args.artifact)
        for path in args.graph:
            engines[path.name] = DeviceBoundSession(path, "cuda", kernels_library=kernels_library("auto", "cuda"))
    else:
        work = Path(tempfile.mkdtemp())
        _, model, artifacts = build("base", "cuda", work, stdlib_docstrings(6000), list(PACKED_KINDS))
        library = kernels_library("auto", "cuda")
        engines = {"torch sdpa": TorchEngine(model, "cuda", torch.float16)}
        for kind, artifact in artifacts.items():  # padded, packed, packed-mha; each with our kernels when built
            engines[f"ort {kind}"] = DeviceBoundSession(work / kind / artifact.graph("fp16").file, "cuda")
            if kernels := artifact.graph("fp16").custom_kernels:
                engines[f"ort {kind}+kernels"] = DeviceBoundSession(work / kind / kernels.file, "cuda",
                                                                    kernels_library=library)
    vocab_size = read_manifest(args.artifact).vocab_size if args.artifact else VOCAB_SIZE
    feed = fixed_batch(batch, length, np.random.default_rng(0), vocab_size)
    product_flops = 2 * 12 * (12 * 768 * 768) * batch * length  # the encoder's Q/K/V, output and FFN products
    for name, engine in engines.items():
        by_kind, by_name, idle_before = kernel_times(engine, feed)
        total_ms = sum(by_kind.values()) / RUNS / 1000
        back_to_back, each = wall_ms(engine, feed)
        both = "" if getattr(engine, "cuda_graph", False) or args.artifact is None else \
            f", {two_threads_batch_ms(engine, feed):.2f} ms a batch from two threads at once"
        print(f"== {name} b={batch} L={length}: GPU kernel time {total_ms:.2f} ms/batch "
              f"({batch / total_ms * 1000:,.0f} seq/s if back to back); wall {back_to_back:.2f} ms back to back, "
              f"{each:.2f} ms one at a time{both}")
        for k, us in by_kind.most_common():
            print(f"   {k:<10} {us / RUNS / 1000:7.3f} ms  {us / RUNS / 1000 / total_ms:5.1%}")
        print(f"   gemm rate on encoder GEMM FLOPs: {product_flops / (by_kind['gemm'] / RUNS / 1e6) / 1e12:.0f} TFLOP/s")
        for kernel, us in by_name.most_common(12):
            print(f"     {us / RUNS / 1000:7.3f} ms  {kernel}")
        print(f"   GPU idle between kernels: {sum(idle_before.values()) / RUNS / 1000:.3f} ms/batch "
              f"(between runs included); the most before:")
        for kernel, us in idle_before.most_common(6):
            print(f"     {us / RUNS / 1000:7.3f} ms  {kernel}")


if __name__ == "__main__":
    main()
