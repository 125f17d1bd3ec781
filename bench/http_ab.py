"""Interleaved A/B of server variants under the same HTTP load: medians and ranges, not single runs.

One run of `bench/http_load.py serving` varies by about ±10% from the next on the same GPU host, as much as
most changes it should judge. Here each variant (a source tree and BERTSERVE_* settings) gets its own server,
loaded at every request size as `serving` loads one (http_load.serve_and_load), and the variants take turns,
`--repeats` times, in alternating order (A B C, C B A, ...), so that a host's drift reaches every variant
alike. It prints, per variant and request size, the median requests/s with its range, the median p99 and
the failed requests (a 429 counts: keep --max-inflight-texts under the servers' queue limit), and with
--engine-batches each over the engine alone, measured once first; it writes every run and that summary as
JSON (--out, or http_ab.json under $OUT).

  python bench/http_ab.py --artifact ART --device cuda --precision fp16 --workers 12 --processes 8 \\
      --connections 32 --clients wrk --texts-per-request 1,64 --repeats 3 --engine-batches 1,256 \\
      --variant before ab/before --variant after . --variant two-engines . cuda_device_ids=0,0

A variant is NAME TREE [SETTING=VALUE ...]: TREE is a checkout (`git worktree add`, or `git archive REV |
tar -x -C DIR`) whose app/ the server runs, with the artifact's custom-kernels library built in it or named
by BERTSERVE_KERNELS_LIBRARY; the settings come after the shared ones (--set). `model_dir=PATH` serves
another artifact than --artifact (two exports of one model, say; the engine alone is measured on --artifact).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.http_load import (add_text_length_arguments, engine_reference, make_texts,  # noqa: E402
                             require_fast_protocols, serve_and_load, server_settings)


def parse_variant(words: list[str]) -> dict:
    if len(words) < 2:
        raise SystemExit(f"--variant {' '.join(words)}: give NAME TREE [SETTING=VALUE ...]")
    name, tree, *settings = words
    if not (Path(tree) / "app" / "__main__.py").is_file():
        raise SystemExit(f"--variant {name}: {tree} is not a checkout of this project (no app/__main__.py)")
    if bad := [s for s in settings if "=" not in s]:
        raise SystemExit(f"--variant {name}: {bad[0]!r} is not SETTING=VALUE")
    for value in (s.split("=", 1)[1] for s in settings if s.split("=", 1)[0] == "model_dir"):
        if not (Path(value) / "manifest.json").is_file():
            raise SystemExit(f"--variant {name}: model_dir {value} is not an artifact (no manifest.json)")
    return {"name": name, "tree": str(Path(tree).resolve()), "set": settings}


def order(variants: list[dict], repeat: int) -> list[dict]:
    """Forward on even repeats, backward on odd ones: each variant's mean position is the same."""
    return variants if repeat % 2 == 0 else variants[::-1]


def summarise(runs: dict[str, list[dict]]) -> dict:
    """Per variant, per run key (x1-wrk, c1_short, ...): the median of each figure and the range of the
    throughput over the repeats."""
    out: dict = {}
    for name, repeats in runs.items():
        out[name] = {}
        for key in repeats[0]:
            values = [r[key] for r in repeats if key in r]
            if key.startswith("c1_short"):
                out[name][key] = {f: round(statistics.median(v[f] for v in values), 3)
                                  for f in ("p50_ms", "p99_ms", "over_engine_ms") if f in values[0]}
                continue
            rates = [v["requests_per_s"] for v in values]
            out[name][key] = {"requests_per_s": round(statistics.median(rates)),
                              "requests_per_s_range": [round(min(rates)), round(max(rates))],
                              "texts_per_s": round(statistics.median(v["texts_per_s"] for v in values)),
                              "p99_ms": round(statistics.median(v["p99_ms"] for v in values), 2),
                              "mean_batch_size": round(statistics.median(v["mean_batch_size"] for v in values), 1),
                              "errors": sum(v["errors"] for v in values), "runs": len(values)}
            for figure, digits in (("x_engine", 3), ("gpu_busy_percent", 1)):
                if all(figure in v for v in values):
                    out[name][key][figure] = round(statistics.median(v[figure] for v in values), digits)
            if all("host_cores" in v.get("server_cpu", {}) for v in values):
                out[name][key]["host_cores"] = round(statistics.median(v["server_cpu"]["host_cores"] for v in values), 1)
    return out


def print_summary(summary: dict) -> None:
    print(f"{'variant':<20}{'load':<14}{'requests/s (median, range)':>32}{'texts/s':>10}{'x engine':>9}{'p99 ms':>9}"
          f"{'batch':>7}{'errors':>8}{'GPU %':>7}{'host cores':>11}")
    for name, keys in summary.items():
        for key, s in keys.items():
            if key.startswith("c1_short"):
                cell = f"p50 {s['p50_ms']} ms, p99 {s['p99_ms']} ms" + (
                    f", engine + {s['over_engine_ms']} ms" if "over_engine_ms" in s else "")
                print(f"{name:<20}{'lone text' + key.removeprefix('c1_short').replace('_', ', '):<14}{cell:>32}")
                continue
            low, high = s["requests_per_s_range"]
            cell = f"{s['requests_per_s']:,} ({low:,}-{high:,}, {s['runs']} runs)"
            print(f"{name:<20}{key:<14}{cell:>32}{s['texts_per_s']:>10,}{s.get('x_engine', ''):>9}{s['p99_ms']:>9}"
                  f"{s['mean_batch_size']:>7}{s['errors']:>8}{s.get('gpu_busy_percent', ''):>7}"
                  f"{s.get('host_cores', ''):>11}")
    if any(s.get("errors") for keys in summary.values() for s in keys.values()):
        print("some requests failed (errors: non-200 answers, 429 past the queue limit among them): their runs "
              "measure refusals too; lower --max-inflight-texts or --connections", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", nargs="+", required=True, metavar="NAME TREE [SETTING=VALUE]",
                        help="a server to compare (at least two)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of every variant, in alternating order")
    parser.add_argument("--artifact", type=Path, required=True, help="artifact folder (python -m export)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--precision", choices=["auto", "fp32", "fp16", "int8"], default="auto")
    parser.add_argument("--workers", type=int, default=8, help="HTTP worker processes of every server")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                        help="a server setting every variant gets (before the variant's own)")
    parser.add_argument("--texts", type=int, default=4096)
    add_text_length_arguments(parser)
    parser.add_argument("--texts-per-request", default="1,64", help="request sizes to load, in turn")
    parser.add_argument("--clients", default="wrk", help="load generators, in turn: python, wrk")
    parser.add_argument("--processes", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="client processes (python) or threads (wrk)")
    parser.add_argument("--connections", type=int, default=32, help="per client process or thread")
    parser.add_argument("--max-inflight-texts", type=int, default=2048,
                        help="texts in flight over all connections (keep it under the servers' max_queued_sequences)")
    parser.add_argument("--engine-batches", default="",
                        help="batch sizes of the engine alone, measured once first in this process (e.g. 1,256): "
                             "each load's x engine, and the short text's time over the engine's batch-1 time")
    parser.add_argument("--engine-seconds", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=6.0, help="seconds per load")
    parser.add_argument("--latency-requests", type=int, default=300, help="one short text at concurrency 1")
    parser.add_argument("--max-wait-ms", type=float, default=0.0)
    parser.add_argument("--inference-workers", type=int, default=0)
    parser.add_argument("--encoding-format", choices=["float", "base64"], default="float")
    parser.add_argument("--pooling", default="cls", help="/embed's pooling in every request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--allow-slow-protocols", action="store_true")
    parser.add_argument("--out", type=Path, help="the JSON (default: $OUT/http_ab.json when OUT is set)")
    args = parser.parse_args(argv)
    variants = [parse_variant(words) for words in args.variant]
    if len(variants) < 2 or len({v["name"] for v in variants}) < len(variants):
        raise SystemExit("give at least two --variant, each with its own name")
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    require_fast_protocols(args.allow_slow_protocols)
    texts = make_texts(args.texts, args.seed, args.min_words, args.max_words)
    out = args.out or (Path(os.environ["OUT"]) / "http_ab.json" if os.environ.get("OUT") else None)
    runs: dict[str, list[dict]] = {v["name"]: [] for v in variants}
    engine = None
    if args.engine_batches:
        print("engine alone ...", file=sys.stderr)
        engine = engine_reference(args.artifact, texts, [int(x) for x in args.engine_batches.split(",")],
                                  args.device, args.precision, args.engine_seconds)

    def write(summary: dict | None) -> None:  # after every run: a lease that ends early keeps what it measured
        if out:
            out.write_text(json.dumps({"variants": variants, "shared_settings": args.set, "engine": engine,
                                       "cpu_count": os.cpu_count(), "summary": summary, "runs": runs}, indent=1))

    for repeat in range(args.repeats):
        for variant in order(variants, repeat):
            print(f"== {variant['name']} (repeat {repeat + 1} of {args.repeats})", file=sys.stderr)
            settings = server_settings(args, args.workers, variant["set"])
            runs[variant["name"]].append(serve_and_load(args, settings, texts, engine, root=Path(variant["tree"])))
            write(None)
    summary = summarise(runs)
    print_summary(summary)
    write(summary)
    if out:
        print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
