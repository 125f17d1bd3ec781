"""Packing a batch for a CUDA-graph replay on the host: `pack_on_host` (fresh arrays each batch) against a
reused `HostPacker` (what a server's lane does), with glibc's default heap thresholds or with the server's
(`app.heap.keep_freed_memory`), in the main thread and in a fresh one. Microseconds a batch, best of 5.

  python bench/host_packing_speed.py            # glibc's defaults
  python bench/host_packing_speed.py --tuned    # the server's thresholds
"""
from __future__ import annotations

import argparse
import sys
import threading
import timeit
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from app.heap import keep_freed_memory  # noqa: E402
from artifact.host_packing import HostPacker, pack_on_host  # noqa: E402

WIDTH = 512  # BERT's maximum length: the token offsets' width
CASES = ((1, 4, 64), (50, 64, 2048), (75, 256, 2048))  # texts, bucket rows, bucket tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tuned", action="store_true", help="set the server's heap thresholds first")
    args = parser.parse_args()
    if args.tuned and not keep_freed_memory():
        sys.exit("no glibc here: nothing to tune")
    rng = np.random.default_rng(0)
    for texts, rows, tokens in CASES:
        lengths = rng.integers(8, 45, texts).astype(np.int64)  # 26 tokens on average, as bench/http_load.py's
        ids = rng.integers(0, 2000, int(lengths.sum())).astype(np.int64)
        types = np.zeros_like(ids)
        packer = HostPacker(rows, WIDTH)
        ways = {"pack_on_host": lambda: pack_on_host(lengths, ids, types, rows, tokens, WIDTH, 0),
                "HostPacker": lambda: packer.pack(lengths, ids, types, tokens, 0)}
        for name, call in ways.items():
            times = {}

            def measure(where: str) -> None:
                times[where] = min(timeit.repeat(call, number=200, repeat=5)) / 200 * 1e6

            fresh = threading.Thread(target=measure, args=("fresh thread",))
            fresh.start()
            fresh.join()
            measure("main thread")
            print(f"{texts:4d} texts in {rows:3d} x {tokens:5d}, {name:13s}: "
                  + ", ".join(f"{where} {us:6.1f} us" for where, us in times.items()))


if __name__ == "__main__":
    main()
