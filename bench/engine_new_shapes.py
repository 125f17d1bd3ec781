"""What a batch costs the server's engine when its token count is new to the process, against the same
batch run again. The packed graph's shapes follow the batch's real tokens, so under live traffic most
batches bring a token count the process has not met yet: whatever is prepared per shape (by ONNX
Runtime, cuBLAS, or our operator's cuBLASLt plans) is paid on the serving path.

Batches of --rows texts of random lengths (--min-len..--max-len tokens), each with a distinct total
token count; timed on their first run ("new"), then the same batches again ("seen"). Medians and means,
ms per batch, for each --kernels choice in turn (one engine each, in this process).

  python bench/engine_new_shapes.py ART [--rows 32,64] [--batches 40] [--kernels on,off]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import artifact.session as session_module  # noqa: E402
from app.engine import Batch, OrtEngine  # noqa: E402
from artifact.manifest import CLS_EMBEDDING, read_manifest  # noqa: E402


def ragged_batches(rows: int, count: int, min_len: int, max_len: int, vocab: int, pad_id: int,
                   rng: np.random.Generator, taken: set[int]) -> list[Batch]:
    """`count` batches of `rows` texts whose total token counts differ from each other and from `taken`."""
    batches = []
    while len(batches) < count:
        lengths = rng.integers(min_len, max_len + 1, rows)
        if int(lengths.sum()) in taken:
            continue
        taken.add(int(lengths.sum()))
        width = int(lengths.max())
        mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)
        ids = np.where(mask == 1, rng.integers(5, vocab, (rows, width)), pad_id).astype(np.int64)
        batches.append(Batch(ids, mask, np.zeros_like(ids), (CLS_EMBEDDING,)))
    return batches


def timed(engine: OrtEngine, batches: list[Batch]) -> list[float]:
    out = []
    for b in batches:
        started = time.perf_counter()
        engine.run(b)
        out.append((time.perf_counter() - started) * 1e3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--rows", default="32,64")
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--min-len", type=int, default=8)
    p.add_argument("--max-len", type=int, default=48)
    p.add_argument("--kernels", default="on,off")
    p.add_argument("--cuda-graphs", default="off", help="off: every batch on the packed graph")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: fp32 (a check of this script)")
    p.add_argument("--session-options", default="default",
                   help="comma-separated ONNX Runtime session variants, each timed in turn: default, "
                        "no-mem-pattern (SessionOptions.enable_mem_pattern off)")
    args = p.parse_args()
    manifest = read_manifest(args.artifact)
    pad_id = manifest.special_tokens.get("[PAD]", 0)
    results = {}
    server_options = session_module._options  # the server's own SessionOptions, varied per --session-options
    for kernels, variant in ((k, v) for k in args.kernels.split(",") for v in args.session_options.split(",")):
        def options(threads, variant=variant):
            o = server_options(threads)
            if variant == "no-mem-pattern":
                o.enable_mem_pattern = False
            return o

        with mock.patch.object(session_module, "_options", options):  # read when the sessions are made
            engine = OrtEngine(args.artifact, manifest, args.device, "fp16" if args.device == "cuda" else "fp32",
                               kernels=kernels, cuda_graphs=args.cuda_graphs)
        rng, taken = np.random.default_rng(0), set()
        warm = ragged_batches(8, 5, args.min_len, args.max_len, manifest.vocab_size, pad_id, rng, taken)
        timed(engine, warm * 3)
        for rows in (int(r) for r in args.rows.split(",")):
            batches = ragged_batches(rows, args.batches, args.min_len, args.max_len, manifest.vocab_size, pad_id,
                                     rng, taken)
            new, seen = timed(engine, batches), timed(engine, batches)
            row = {"new_median_ms": round(statistics.median(new), 3), "new_mean_ms": round(statistics.mean(new), 3),
                   "seen_median_ms": round(statistics.median(seen), 3),
                   "seen_mean_ms": round(statistics.mean(seen), 3)}
            results[f"{engine.graph_file} {variant} rows={rows}"] = row
            print(f"{engine.graph_file:<28} {variant:<15} {rows:>3} rows of {args.min_len}-{args.max_len} tokens: "
                  f"new token count {row['new_median_ms']} ms median ({row['new_mean_ms']} mean), seen {row['seen_median_ms']} ms "
                  f"({row['seen_mean_ms']} mean)", flush=True)
        del engine
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "engine_new_shapes.json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
