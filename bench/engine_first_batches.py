"""The server's engine (app.engine.OrtEngine) in a fresh process: one small batch (a CUDA-graph replay, with CUDA
graphs on), then batches of 64, 128 and 256 texts of 128 tokens, each timed on its
first run and then as the median of ten. The first run of each size pays custom_kernels' autotuning
(BERTSERVE_KERNELS_AUTOTUNE=0 to compare); run it several times to see start-up failures. With
--ragged-rows, batches of those many texts of random lengths (8-128 tokens) follow, timed the same way:
what a new batch shape costs the packed graph the first time (plans made per shape, by ORT and by our
operator).

  python bench/engine_first_batches.py ART [--kernels auto|on|off] [--cuda-graphs auto|on|off]
      [--cuda-graph-rows 16] [--first-rows 2] [--only-first] [--ragged-rows 17,23,40]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from app.engine import Batch, OrtEngine  # noqa: E402
from artifact.manifest import CLS_EMBEDDING, read_manifest  # noqa: E402
from bench.engine_throughput import fixed_batch  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--kernels", default="on")
    p.add_argument("--cuda-graphs", default="auto")
    p.add_argument("--cuda-graph-rows", type=int, default=16)
    p.add_argument("--first-rows", type=int, default=2, help="rows of the first, small batch (16 tokens)")
    p.add_argument("--only-first", action="store_true", help="stop after the first batch")
    p.add_argument("--ragged-rows", default="", help="comma-separated row counts of random-length batches")
    args = p.parse_args()
    manifest = read_manifest(args.artifact)
    engine = OrtEngine(args.artifact, manifest, "cuda", "fp16", kernels=args.kernels, cuda_graphs=args.cuda_graphs,
                       cuda_graph_rows=args.cuda_graph_rows)
    rng = np.random.default_rng(0)

    def batch(rows: int, length: int) -> Batch:
        return Batch(**fixed_batch(rows, length, rng, manifest.vocab_size), outputs=(CLS_EMBEDDING,))

    engine.run(batch(args.first_rows, 16))
    if args.only_first:
        return
    tuning = os.environ.get("BERTSERVE_KERNELS_AUTOTUNE", "on")

    def first_and_median(b: Batch) -> str:
        started = time.perf_counter()
        engine.run(b)
        first = time.perf_counter() - started
        times = []
        for _ in range(10):
            started = time.perf_counter()
            engine.run(b)
            times.append(time.perf_counter() - started)
        return f"first run {first * 1e3:.1f} ms, then median {np.median(times) * 1e3:.2f} ms"

    for rows in (64, 128, 256):  # 8,192, 16,384 and 32,768 tokens: three size classes
        print(f"autotune={tuning} rows={rows} x 128: {first_and_median(batch(rows, 128))}", flush=True)
    for rows in (int(r) for r in args.ragged_rows.split(",") if r):
        b = batch(rows, 128)
        lengths = rng.integers(8, 129, size=rows)
        mask = (np.arange(128)[None, :] < lengths[:, None]).astype(np.int64)
        b = Batch(b.input_ids * mask, mask, b.token_type_ids * mask, b.outputs)
        print(f"rows={rows}, lengths 8-128 (longest {lengths.max()}): {first_and_median(b)}", flush=True)


if __name__ == "__main__":
    main()
