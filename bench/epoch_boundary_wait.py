"""How long the trainer waits for its batch where an epoch starts, against within an epoch.

Each epoch draws new sentence pairs, a pass over the whole corpus in Python. This runs the trainer's
BatchStream with data workers over a prepared corpus, taking one batch per simulated step (a sleep, as
a GPU step leaves the CPU free), and prints the wait for each batch: the largest at the first batch of
each epoch against the median elsewhere.

  python bench/epoch_boundary_wait.py --corpus docstrings.jsonl --cache-dir /tmp/cache --epochs 3
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.batch_stream import BatchStream  # noqa: E402
from training.data import DataConfig, prepare_data  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", nargs="*", default=[], help="as pretrain's --corpus (none: the embedded default)")
    p.add_argument("--cache-dir", default=".cache/bertserve")
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--step-ms", type=float, default=30.0, help="simulated step time")
    p.add_argument("--epochs", type=int, default=3, help="epoch boundaries to cross")
    args = p.parse_args()

    data = prepare_data(DataConfig(corpus=tuple(args.corpus), cache_dir=args.cache_dir,
                                   max_seq_len=args.max_seq_len), show_progress=False).train
    per_epoch = data.num_batches(0, args.batch_size)
    print(f"{data.num_examples(0):,} pairs, {per_epoch} batches of {args.batch_size} an epoch, "
          f"{args.workers} workers, {args.step_ms:g} ms a step")
    within, boundaries = [], []
    with BatchStream(data, args.batch_size, seed=0, workers=args.workers) as stream:
        stream.next()  # the workers' start
        while True:
            started = time.perf_counter()
            batch = stream.next()
            waited = time.perf_counter() - started
            if batch.epoch >= args.epochs + 1:
                break
            (boundaries if batch.index == 0 else within).append(waited)
            time.sleep(args.step_ms / 1e3)
    print(f"wait for a batch within an epoch: median {statistics.median(within) * 1e3:.2f} ms, "
          f"max {max(within) * 1e3:.1f} ms")
    print("at each epoch's first batch: " + ", ".join(f"{w * 1e3:.0f} ms" for w in boundaries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
