"""What a batch of one-text requests costs the engine on the GPU, by path: the packed graph (ONNX Runtime
launching every kernel), CUDA-graph replays of the padded twin with the whole batch in one bucket (padded
to its longest text), and replays planned by length (app/cuda_graphs.ReplayPlanner). The engine is the
server's own OrtEngine over an artifact with a packed graph and its padded twin, as `python -m export
--device cuda` wrote them before the host-packed variant replaced the twin (bench/packed_cuda_graphs.py
measures that one); the texts are bench/http_load.py's.

Also: a replay's fixed cost and its cost per padded token, timed on single buckets, from which the
planner's REPLAY_COST_TOKENS is chosen; and two threads running packed batches at once (does a second
inference worker add GPU throughput, or only wait?).

  python bench/cuda_graph_replays.py --artifact ART --rows 16,32,48,64      # GPU machine

Sizes marked L have one long text (about 120 tokens) among the short ones.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import numpy as np  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from app.cuda_graphs import ReplayPlanner  # noqa: E402
from app.engine import Batch, OrtEngine  # noqa: E402
from artifact.manifest import CLS_EMBEDDING, read_manifest  # noqa: E402
from bench.http_load import make_texts  # noqa: E402


def batches(tokenizer: Tokenizer, rows: int, count: int, rng: np.random.Generator, pad: int,
            one_long: bool = False) -> list[Batch]:
    """`count` batches of `rows` texts drawn from bench/http_load.py's; with `one_long`, the first text of
    each is a long one (about 120 tokens, cut at 128): the batch the planner is for."""
    texts = make_texts(4000)
    long_texts = make_texts(count, seed=1, min_words=95, max_words=110)
    out = []
    for n in range(count):
        chosen = [texts[i] for i in rng.choice(len(texts), rows, replace=False)]
        if one_long:
            chosen[0] = long_texts[n]
        encodings = tokenizer.encode_batch(chosen)
        for e in encodings:
            e.truncate(128)
        width = max(len(e.ids) for e in encodings)
        ids = np.full((rows, width), pad, np.int64)
        mask = np.zeros_like(ids)
        for r, e in enumerate(encodings):
            ids[r, :len(e.ids)], mask[r, :len(e.ids)] = e.ids, 1
        out.append(Batch(ids, mask, np.zeros_like(ids), (CLS_EMBEDDING,)))
    return out


def ms_per_batch(run, work: list[Batch], rounds: int = 3) -> float:
    """Median over rounds of the mean wall time per batch, each batch waited for (as the engine does)."""
    run(work[0])
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for b in work:
            run(b)
        times.append((time.perf_counter() - started) / len(work) * 1000)
    return statistics.median(times)


def two_threads_ms(call: Callable[[int, int], object], calls: int) -> float:
    """Milliseconds per call with two threads each making `calls` calls at once: call(thread, k), k < calls
    (thread 0 or 1: each thread may need its own buffers)."""
    barrier = threading.Barrier(3)

    def worker(thread: int):
        barrier.wait()
        for k in range(calls):
            call(thread, k)
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    barrier.wait()
    started = time.perf_counter()
    for t in threads:
        t.join()
    return (time.perf_counter() - started) / (2 * calls) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--rows", default="16,32,48,64", help="texts per batch")
    parser.add_argument("--batches", type=int, default=100, help="distinct batches per size")
    parser.add_argument("--kernels", default="auto", choices=["auto", "on", "off"])
    args = parser.parse_args()
    sizes = [int(n) for n in args.rows.split(",")]
    manifest = read_manifest(args.artifact)
    engine = OrtEngine(args.artifact, manifest, "cuda", "fp16", kernels=args.kernels, cuda_graphs="on",
                       cuda_graph_rows=max(sizes))
    packed_engine = OrtEngine(args.artifact, manifest, "cuda", "fp16", kernels=args.kernels, cuda_graphs="off")
    buckets = engine.graph_buckets
    if buckets is None or not packed_engine.packed:
        parser.error(f"{args.artifact} has no packed fp16 graph with a padded twin (see this script's docstring)")
    planned = buckets.planner
    one_bucket = ReplayPlanner(buckets.rows, buckets.lengths, replay_cost=10**9)
    print(f"{engine.graph_file} (custom kernels: {engine.custom_kernels}); buckets rows {buckets.rows} x lengths "
          f"{buckets.lengths}", flush=True)
    report: dict = {"graph": engine.graph_file, "buckets": {"rows": buckets.rows, "lengths": buckets.lengths}}

    # A replay's cost: time single-bucket batches (all rows at the bucket's length) of every size.
    probes = []
    for rows in buckets.rows:
        for length in buckets.lengths:
            ids = np.full((rows, length), 1000, np.int64)
            b = Batch(ids, np.ones_like(ids), np.zeros_like(ids), (CLS_EMBEDDING,))
            probes.append((rows * length, ms_per_batch(lambda x: buckets.run(x.input_ids, x.attention_mask,
                                                                           x.token_type_ids, x.outputs), [b] * 30)))
    tokens, ms = np.array(probes, dtype=float).T
    slope, fixed = np.polyfit(tokens, ms, 1)
    small = [m for t, m in probes if t <= 512]
    print(f"replay of a single bucket: {fixed:.3f} ms + {slope * 1000:.3f} us per padded token (least squares "
          f"over {len(probes)} buckets); buckets of <= 512 tokens {min(small):.3f}-{max(small):.3f} ms; "
          f"-> about {fixed / slope:.0f} tokens a replay", flush=True)
    report["replay_fit"] = {"fixed_ms": fixed, "us_per_token": slope * 1000, "tokens_per_replay": fixed / slope,
                            "probes": probes}

    rng = np.random.default_rng(0)
    tokenizer = Tokenizer.from_file(str(args.artifact / "tokenizer.json"))
    pad = manifest.special_tokens.get("[PAD]", 0)
    print(f"{'texts':>5} {'real tok':>8} {'one-bucket tok':>14} {'planned tok':>11} {'replays':>7} | ms a batch: "
          f"{'packed':>7} {'packed x2 thr':>13} {'one bucket':>10} {'planned':>8} | planned texts/s", flush=True)
    report["sizes"] = {}
    for rows, one_long in [(n, False) for n in sizes] + [(n, True) for n in sizes if n >= 16]:
        work = batches(tokenizer, rows, args.batches, rng, pad, one_long)
        lengths = [b.attention_mask.sum(1) for b in work]
        padded_one = np.mean([sum(r * L for _, r, L in one_bucket.plan(x)) for x in lengths])
        plans = [planned.plan(x) for x in lengths]
        padded_planned = np.mean([sum(r * L for _, r, L in p) for p in plans])
        replays = np.mean([len(p) for p in plans])

        def replay(b):
            return buckets.run(b.input_ids, b.attention_mask, b.token_type_ids, b.outputs)
        packed = ms_per_batch(packed_engine.run, work)
        packed_two = two_threads_ms(lambda _, k: packed_engine.run(work[k]), len(work))
        buckets.planner = one_bucket
        whole = ms_per_batch(replay, work)
        buckets.planner = planned
        split = ms_per_batch(replay, work)
        real = np.mean([x.sum() for x in lengths])
        print(f"{rows:>4}{'L' if one_long else ' '} {real:>8.0f} {padded_one:>14.0f} {padded_planned:>11.0f} "
              f"{replays:>7.1f} | {'':>10}{packed:>7.3f} {packed_two:>13.3f} {whole:>10.3f} {split:>8.3f} | {rows / split * 1000:,.0f}",
              flush=True)
        name = f"{rows}{' with one long text' if one_long else ''}"
        report["sizes"][name] = {"real_tokens": real, "one_bucket_tokens": padded_one,
                                 "planned_tokens": padded_planned, "replays": replays, "packed_ms": packed,
                                 "packed_two_threads_ms_each": packed_two, "one_bucket_ms": whole,
                                 "planned_ms": split}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "cuda_graph_replays.json").write_text(json.dumps(report, indent=1, default=float))


if __name__ == "__main__":
    main()
