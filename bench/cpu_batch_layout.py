"""How to spend CPU cores on batches: one batch over all cores, or one single-threaded batch per core,
at several token budgets (the server's max_batch_tokens, counted padded). The raw engine only (the
server's tokenizer, collation and OrtEngine; no HTTP), texts sorted by length as the batcher packs them,
configurations interleaved and repeated because shared VMs are noisy; prints median and best texts/s.

  python bench/cpu_batch_layout.py --artifact ART --precision fp32 [--texts 128] [--min-words 40 --max-words 100]

The defaults in app/build.py (one batch per core, one thread each, 512 tokens) come from this.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from app.batcher import Sequences, collate  # noqa: E402
from app.build import usable_cores  # noqa: E402
from app.engine import OrtEngine  # noqa: E402
from app.tokenization import TextTokenizer  # noqa: E402
from artifact.manifest import CLS_EMBEDDING, TOKENIZER_FILE, read_manifest  # noqa: E402
from bench.http_load import make_texts  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--artifact", type=Path, required=True)
    p.add_argument("--precision", choices=["fp32", "int8"], default="fp32")
    p.add_argument("--texts", type=int, default=128)
    p.add_argument("--min-words", type=int, default=40)
    p.add_argument("--max-words", type=int, default=100)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--budgets", default="128,256,512,1024,2048")
    args = p.parse_args()

    cores = usable_cores()  # as the server counts them
    manifest = read_manifest(args.artifact)
    tokenizer = TextTokenizer(args.artifact / TOKENIZER_FILE, manifest.max_length, 2_000_000, manifest.special_tokens)
    texts = make_texts(args.texts, 0, args.min_words, args.max_words)
    encoded = sorted(tokenizer.encode(texts, True), key=lambda e: e.length)
    engines = {threads: OrtEngine(args.artifact, manifest, "cpu", args.precision, threads) for threads in {1, cores}}
    outputs = frozenset({CLS_EMBEDDING})

    def texts_per_s(threads: int, workers: int, budget: int) -> float:
        batches, current = [], []
        for e in encoded:
            if current and (len(current) + 1) * e.length > budget:
                batches.append(current)
                current = []
            current.append(e)
        batches.append(current)
        engine = engines[threads]

        def work(k: int) -> None:
            for b in batches[k::workers]:
                engine.run(collate(Sequences.concat([e.ids for e in b], [e.type_ids for e in b]), engine.pad_id,
                                   outputs))

        started = time.perf_counter()
        pool = [threading.Thread(target=work, args=(k,)) for k in range(workers)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        return len(encoded) / (time.perf_counter() - started)

    layouts = [(cores, 1, 4096)] + [(1, cores, int(b)) for b in args.budgets.split(",")]
    for layout in layouts:
        texts_per_s(*layout)  # warm-up
    runs: dict[tuple, list[float]] = {layout: [] for layout in layouts}
    for _ in range(args.repeats):
        for layout in layouts:
            runs[layout].append(texts_per_s(*layout))
    mean_tokens = statistics.mean(e.length for e in encoded)
    print(f"{args.precision}, {cores} cores, {len(encoded)} texts, mean {mean_tokens:.0f} tokens")
    for (threads, workers, budget), values in runs.items():
        print(f"  {workers} batch(es) x {threads} thread(s), budget {budget:>5}: "
              f"median {statistics.median(values):6.1f}  best {max(values):6.1f} texts/s")


if __name__ == "__main__":
    main()
