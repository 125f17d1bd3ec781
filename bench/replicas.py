"""Serving on several GPUs of one host, the two layouts side by side: one server per GPU (what one
container or Kubernetes pod per GPU gives) against one server with an engine process per GPU
(`cuda_device_ids`), each against one GPU alone, on the same artifact, texts and client load per GPU.

  python bench/replicas.py --artifact ART --gpus 0,1 --workers 8 --processes 6 --encoding-format base64
  python bench/replicas.py --artifact ART --device cpu --gpus 0,1 --workers 1 --processes 1 --duration 2  # smoke

Prints texts/s per run and the ratio to one GPU; writes replicas.json under $OUT when set. Loopback only.
On the CPU (`--device cpu`) the per-GPU servers are plain CPU servers and the one-server layout is skipped:
a check that the script runs, not a measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.http_load import _all_workers_up, make_texts, multiprocess_load, serve  # noqa: E402


# Untimed load on every server after it starts: the first batches of each shape are slow, and the queue's
# admission estimates the engine's speed from them.
WARM_UP_S = 3.0


def _settings(args, **extra) -> dict:
    settings = {"device": args.device, "max_wait_ms": 0, **extra}
    settings.update(item.split("=", 1) for item in args.set)
    return settings


def _load_at_once(urls: list[str], args, texts: list[str], processes: int, workers: int,
                  duration: float | None = None) -> list[dict]:
    """Each URL (a server of `workers` HTTP workers) loaded by its own `processes` client processes, all at
    the same time."""
    connections = max(1, args.max_inflight_texts // (args.texts_per_request * args.processes))
    results: list[dict | None] = [None] * len(urls)

    def load(i: int) -> None:
        engine, pids = _all_workers_up(urls[i], workers)
        results[i] = multiprocess_load(urls[i], texts, args.texts_per_request, processes, connections,
                                       duration or args.duration, args.encoding_format, (engine, {engine, *pids}))

    threads = [threading.Thread(target=load, args=(i,)) for i in range(len(urls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(r is None for r in results):
        raise SystemExit("a load run failed (see above)")
    return results


def _row(label: str, runs: list[dict]) -> dict:
    return {"layout": label, "texts_per_s": round(sum(r["texts_per_s"] for r in runs), 1),
            "per_server": [r["texts_per_s"] for r in runs], "p99_ms": max(r["p99_ms"] for r in runs),
            "errors": sum(r["errors"] for r in runs), "server_cpu": [r.get("server_cpu") for r in runs]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--gpus", default="0,1", help="CUDA device ids, one server (or engine) each")
    parser.add_argument("--workers", type=int, default=8, help="HTTP workers per GPU")
    parser.add_argument("--processes", type=int, default=6, help="client processes per GPU")
    parser.add_argument("--texts-per-request", type=int, default=64)
    parser.add_argument("--max-inflight-texts", type=int, default=2048, help="texts in flight per GPU")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per run")
    parser.add_argument("--encoding-format", choices=["float", "base64"], default="float")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a server setting")
    args = parser.parse_args(argv)
    gpus = [int(g) for g in args.gpus.split(",")]
    texts = make_texts(4096)
    rows = []
    with ExitStack() as stack:  # one server per GPU, started once, loaded alone and together
        urls = [stack.enter_context(serve(args.artifact, **_settings(args, workers=args.workers,
                                                                     cuda_device_id=gpu))) for gpu in gpus]
        _load_at_once(urls, args, texts, args.processes, args.workers, WARM_UP_S)
        rows.append(_row("one GPU, one server", _load_at_once(urls[:1], args, texts, args.processes, args.workers)))
        rows.append(_row(f"{len(gpus)} servers, one per GPU",
                         _load_at_once(urls, args, texts, args.processes, args.workers)))
        rows.append(_row("one GPU, one server, again",
                         _load_at_once(urls[:1], args, texts, args.processes, args.workers)))
    if args.device == "cuda":
        with serve(args.artifact, **_settings(args, workers=args.workers * len(gpus),
                                              cuda_device_ids=args.gpus)) as url:
            _load_at_once([url], args, texts, args.processes * len(gpus), args.workers * len(gpus), WARM_UP_S)
            rows.append(_row(f"one server, an engine per GPU ({len(gpus)} GPUs)",
                             _load_at_once([url], args, texts, args.processes * len(gpus),
                                           args.workers * len(gpus))))
    one = (rows[0]["texts_per_s"] + rows[2]["texts_per_s"]) / 2
    for r in rows:
        r["x_one_gpu"] = round(r["texts_per_s"] / one, 3)
        print(f"{r['layout']:<44}{r['texts_per_s']:>12,.0f} texts/s{r['x_one_gpu']:>8}x  p99 {r['p99_ms']} ms"
              f"  errors {r['errors']}")
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "replicas.json"
        path.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}, indent=2))
        print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
