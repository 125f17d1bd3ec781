"""py-spy on one HTTP worker and on the engine process of a live server under closed-loop `wrk` load.

Where the CPU of each process goes while it serves, sampled without stopping it (idle samples kept, so
a thread's share of samples is its share of time):

  python bench/live_profile.py ART --out /tmp/spy        # /tmp/spy/{worker,engine}.raw: py-spy's raw format
  python bench/live_profile.py ART --texts-per-request 64 --connections 4

Needs py-spy (pip install py-spy) and wrk (bench/wrk_load.py) on PATH or in $WRK.
"""
from __future__ import annotations

import argparse
import collections
import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.http_load import _all_workers_up, make_texts, serve, wrk_load  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--out", type=Path, default=Path("live-profile"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--threads", type=int, default=8, help="wrk threads")
    parser.add_argument("--connections", type=int, default=32, help="per wrk thread")
    parser.add_argument("--texts-per-request", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=8, help="sampled, after 4 s of load")
    parser.add_argument("--rate", type=int, default=250, help="samples a second")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a server setting")
    parser.add_argument("--top", type=int, default=20, help="functions listed per engine thread")
    args = parser.parse_args()
    spy = shutil.which("py-spy") or sys.exit("py-spy is not on PATH (pip install py-spy)")
    args.out.mkdir(parents=True, exist_ok=True)
    texts = make_texts(4096, 0)
    settings = dict(item.split("=", 1) for item in args.set)
    with serve(args.artifact, device=args.device, workers=args.workers, max_wait_ms=0.0, **settings) as url:
        engine_pid, workers = _all_workers_up(url, args.workers)
        result: dict = {}
        load = threading.Thread(target=lambda: result.update(wrk_load(
            url, texts, args.texts_per_request, args.threads, args.connections, args.seconds + 8,
            server=(engine_pid, {engine_pid, *workers}))))
        load.start()
        time.sleep(4)
        spies = [subprocess.Popen([spy, "record", "--pid", str(pid), "--duration", str(round(args.seconds)),
                                   "--rate", str(args.rate), "--format", "raw", "--nonblocking", "--idle", *extra,
                                   "--output", str(args.out / f"{name}.raw")],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
                 for name, pid, extra in (("worker", min(workers), []), ("engine", engine_pid, ["--threads"]))]
        for s in spies:
            s.wait()
        load.join()
    print(json.dumps({k: result.get(k) for k in ("requests_per_s", "p99_ms", "server_cpu")}))
    print(f"wrote {args.out}/worker.raw and {args.out}/engine.raw", file=sys.stderr)
    for line in thread_summary(args.out / "engine.raw", args.top):
        print(line)


def thread_summary(raw: Path, top: int) -> list[str]:
    """Per thread of a `py-spy record --threads --idle --format raw` file: its samples, and the functions
    (inclusive: a function counts in every sample it is on the stack of) that took most of them."""
    threads: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    totals: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        thread = frames[0].split(":", 1)[-1].strip()
        totals[thread] += int(count)
        for name in {f.split(" (")[0] + " (" + f.split(" (")[-1].split(":")[0] + ")" for f in frames[1:]}:
            threads[thread][name] += int(count)
    lines = []
    for thread, samples in totals.most_common():
        lines.append(f"{thread}: {samples} samples")
        shares = [(name, n) for name, n in threads[thread].most_common() if n < samples]  # not the thread's base
        lines += [f"  {100 * n / samples:5.1f}%  {name}" for name, n in shares[:top]]
    return lines


if __name__ == "__main__":
    main()
