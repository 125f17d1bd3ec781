"""Soak: `python -m app` under a steady mix of requests (texts, pairs, tokens, NSP, OpenAI, bad bodies) for
a while; the server's memory (RSS of every process of it, and on a GPU the device memory they hold)
sampled along the way must stay flat, and every answer be the expected status. --random-texts: every
other request is 1 to 64 texts of 1 to 400 words, seeded, so the engine meets many batch shapes (429,
overloaded, counted apart: this mix can outrun a small CPU).

  python bench/soak.py --artifact ARTIFACT --minutes 2 [--workers 2] [--clients 8] [--random-texts]
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.test_server import start_server  # noqa: E402

REQUESTS = [  # (path, body, expected status)
    ("/embed", {"inputs": ["a short text", "and another, somewhat longer one"]}, 200),
    ("/embed", {"inputs": [["a question?", "its answer."]], "return_tokens": True}, 200),
    ("/embed", {"inputs": "base64 please", "encoding_format": "base64", "pooling": "mean"}, 200),
    ("/nsp", {"pairs": [["It rained.", "The streets were wet."]]}, 200),
    ("/tokenize", {"inputs": "tokens of this"}, 200),
    ("/v1/embeddings", {"input": ["openai style"], "model": "x"}, 200),
    ("/embed", {"inputs": ""}, 422),
    ("/embed", {"text": "wrong field"}, 422),
]


WORDS = "the of and a to in is was for on that with as by it from at his an be are this which".split()


def random_texts(rng: random.Random) -> dict:
    """An /embed body of 1 to 64 texts of 1 to 400 words."""
    return {"inputs": [" ".join(rng.choices(WORDS, k=rng.randint(1, 400))) for _ in range(rng.randint(1, 64))]}


def process_tree(pid: int) -> set[int]:
    """`pid` and every descendant."""
    frontier, seen = [pid], set()
    while frontier:
        p = frontier.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                frontier.extend(int(c) for c in (task / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return seen


def rss_mb(pids: set[int]) -> float:
    """RSS of `pids`, in MB."""
    total = 0
    for p in pids:
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS")))
        except (FileNotFoundError, StopIteration, ProcessLookupError):
            continue
    return total / 1024


def gpu_mb(pids: set[int]) -> float | None:
    """GPU memory `pids` hold, in MiB, as nvidia-smi reports it; None without nvidia-smi."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30).stdout
    rows = [line.split(",") for line in out.splitlines() if line.strip()]
    return float(sum(float(used) for pid, used in rows if int(pid) in pids))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", type=Path, required=True)
    p.add_argument("--minutes", type=float, default=2.0)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--random-texts", action="store_true", help="every other request: 1-64 texts of 1-400 words")
    args = p.parse_args()
    proc, base = start_server(args.artifact, ready_s=600, workers=args.workers)
    nsp_status = 200 if httpx.get(f"{base}/info", timeout=30).json()["has_nsp_head"] else 400  # 400: no NSP head
    requests = [(path, body, nsp_status if path == "/nsp" else status) for path, body, status in REQUESTS]
    stop, counts, wrong = threading.Event(), {"requests": 0, "overloaded": 0}, []

    def client(i: int) -> None:
        rng = random.Random(i)
        with httpx.Client(base_url=base, timeout=60) as c:
            k = i
            while not stop.is_set():
                path, body, expected = requests[k % len(requests)]
                if args.random_texts and k % 2:
                    path, body, expected = "/embed", random_texts(rng), 200
                r = c.post(path, json=body)
                counts["requests"] += 1
                if r.status_code == 429 and args.random_texts:  # a heavy mix may outrun a small machine
                    counts["overloaded"] += 1
                elif r.status_code != expected:
                    wrong.append((path, r.status_code, r.text[:200]))
                k += 1

    try:
        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.clients)]
        for t in threads:
            t.start()
        samples, started = [], time.monotonic()
        while time.monotonic() - started < args.minutes * 60:
            time.sleep(5)
            pids = process_tree(proc.pid)
            samples.append((round(time.monotonic() - started), round(rss_mb(pids), 1), gpu_mb(pids)))
        stop.set()
        for t in threads:
            t.join()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    warm = samples[len(samples) // 5]  # after the first fifth: allocator pools and caches have grown
    print(json.dumps({"minutes": args.minutes, "workers": args.workers, "clients": args.clients,
                      "requests": counts["requests"], "overloaded_429": counts["overloaded"], "unexpected_statuses": len(wrong), "first_unexpected": wrong[:3],
                      "random_texts": args.random_texts, "rss_mb_after_warmup": warm[1], "rss_mb_end": samples[-1][1],
                      "gpu_mib_after_warmup": warm[2], "gpu_mib_end": samples[-1][2],
                      "samples_s_rss_mb_gpu_mib": samples, "exit_code": proc.returncode}))


if __name__ == "__main__":
    main()
