"""Overload: many connections, each sending requests back to back for a while, with a client timeout;
how every request ended. With admission by time (`max_queue_ms`) the answers should all come within a
few seconds and the rest be 429s at once, with no client timing out.

  python bench/overload.py --artifact ARTIFACT --connections 256 --texts 8 --duration 30 \
      --settings max_queue_ms=2000 --settings max_queue_ms=   # the second: no limit (before)

Each --settings runs `python -m app` afresh with those BERTSERVE_* values; one JSON line per run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.test_server import running_server  # noqa: E402  (the server as deployed, stopped by SIGTERM)

WORDS = ("the model turns each sentence into a vector that search and clustering can use while the "
         "server batches requests from many clients").split()


def texts(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=rng.integers(8, 40))) for _ in range(n)]


async def load(base: str, connections: int, n_texts: int, duration: float, timeout: float) -> dict:
    outcomes: list[tuple[str, float, float]] = []  # ("200" | "429" | "timeout" | "error", seconds, sent at)
    # Every client made before the clock starts: making 256 of them (an SSL context each) takes the load
    # generator seconds of CPU, which would show as server latency at the start.
    clients = [httpx.AsyncClient(base_url=base, timeout=timeout, trust_env=False) for _ in range(connections)]
    began = time.monotonic()
    stop_at = began + duration

    async def client(i: int) -> None:
        async with clients[i] as c:
            k = 0
            while time.monotonic() < stop_at:
                started = time.monotonic()
                try:
                    r = await c.post("/embed", json={"inputs": texts(n_texts, i * 100_000 + k)})
                    outcomes.append((str(r.status_code), time.monotonic() - started, started - began))
                    if r.status_code == 429:  # as a client honouring Retry-After would (capped: the run is short)
                        await asyncio.sleep(min(float(r.headers.get("retry-after", 1)), 1.0))
                except httpx.TimeoutException:
                    outcomes.append(("timeout", time.monotonic() - started, started - began))
                except httpx.HTTPError:
                    outcomes.append(("error", time.monotonic() - started, started - began))
                k += 1

    await asyncio.gather(*(client(i) for i in range(connections)))
    summary = {}
    for kind in sorted({k for k, _, _ in outcomes}):
        for part, after in (("", -1.0), ("after_first_5s_", 5.0)):  # the connection burst at the start apart
            seconds = np.array([s for k, s, at in outcomes if k == kind and at > after])
            if seconds.size:
                summary[part + kind] = {"count": int(seconds.size), "p50_s": round(float(np.percentile(seconds, 50)), 3),
                                        "p99_s": round(float(np.percentile(seconds, 99)), 3),
                                        "max_s": round(float(seconds.max()), 3)}
    return summary


def server_side(metrics: str) -> dict:
    """The server's own view of /embed (every status): the share answered within 1, 2.5, 5 and 10 s, from
    bertserve_request_duration_seconds, to tell the server's time from the load generator's delays."""
    buckets = {}
    for line in metrics.splitlines():
        if line.startswith("bertserve_request_duration_seconds_bucket") and 'endpoint="/embed"' in line:
            labels, value = line.rsplit(" ", 1)
            buckets[labels.split('le="')[1].split('"')[0]] = float(value)
    total = buckets.get("+Inf", 0)
    return {f"within_{le}s": round(buckets[le] / total, 4) for le in sorted(buckets, key=float)
            if total and le in ("1.0", "2.5", "5.0", "10.0")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", type=Path, required=True)
    p.add_argument("--connections", type=int, default=256)
    p.add_argument("--texts", type=int, default=8, help="texts per request")
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--timeout", type=float, default=30.0, help="the clients' timeout, seconds")
    p.add_argument("--settings", action="append", default=[], help="NAME=VALUE,... for one run (repeatable)")
    args = p.parse_args()
    for spec in args.settings or [""]:
        settings = dict(item.split("=", 1) for item in spec.split(",") if item)
        with running_server(args.artifact, **settings) as base:
            summary = asyncio.run(load(base, args.connections, args.texts, args.duration, args.timeout))
            summary["server"] = server_side(httpx.get(f"{base}/metrics", timeout=30).text)
        print(json.dumps({"settings": settings, "connections": args.connections, "texts_per_request": args.texts,
                          "duration_s": args.duration, "client_timeout_s": args.timeout, "outcomes": summary}),
              flush=True)


if __name__ == "__main__":
    main()
