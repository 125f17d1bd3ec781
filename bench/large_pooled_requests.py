"""Large mean-pooled requests through several HTTP workers: time and memory (RSS of each process of the
server) over a few rounds of one /v1/embeddings request of many long texts. Run it against two trees to
compare them: `python -m app` starts from TREE, so its code is what is measured.

  python bench/large_pooled_requests.py --tree TREE --artifact ART [--workers 2] [--texts 2048] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.soak import process_tree, rss_mb  # noqa: E402
from tests.test_server import start_server  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tree", type=Path, default=ROOT)
    p.add_argument("--artifact", type=Path, required=True)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--texts", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    texts = [" ".join([f"word{i % 50}"] * 240) for i in range(args.texts)]  # past 256 tokens each: cut there
    proc, base = start_server(args.artifact.resolve(), cwd=args.tree.resolve(), ready_s=600, workers=args.workers)
    rounds = []
    try:
        for _ in range(args.rounds):
            started = time.perf_counter()
            r = httpx.post(f"{base}/v1/embeddings", json={"model": "m", "input": texts}, timeout=900)
            pids = process_tree(proc.pid)
            rounds.append({"seconds": round(time.perf_counter() - started, 1), "status": r.status_code,
                           "rss_mb": round(rss_mb(pids), 1),
                           "rss_mb_per_process": sorted(round(rss_mb({pid}), 1) for pid in pids)})
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    print(json.dumps({"tree": str(args.tree), "workers": args.workers, "texts": args.texts, "rounds": rounds}))


if __name__ == "__main__":
    main()
