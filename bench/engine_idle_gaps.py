"""Batch-1 time of one short text when the engine idles between requests, as at concurrency 1 in the
server, against back-to-back calls: the server's OrtEngine on the packed fp16 graph (with and without
the custom kernels, CUDA graphs off), the same engine replaying CUDA graphs (as the server does: of the
host-packed variant, or of the padded twin an older artifact has), and optionally a --keep-padding artifact's graph replayed by bench/engine_throughput.py's
engine. Medians of 300 calls.

  python bench/engine_idle_gaps.py --artifact ART --padded-artifact ART_PADDED   # GPU; ART_PADDED from
                                                                                 # python -m export ... --keep-padding
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SHORT_TEXT = "The quick brown fox jumps over the lazy dog."


def median_ms(call: Callable[[], object], gap_s: float, how: str = "sleep", calls: int = 300) -> float:
    """how: sleep (the core may idle), spin (it stays busy), thread (the call runs in a worker thread, as
    the batcher runs it, after a sleep)."""
    pool = ThreadPoolExecutor(1)
    times = []
    for _ in range(30 + calls):
        if gap_s and how == "spin":
            end = time.perf_counter() + gap_s
            while time.perf_counter() < end:
                pass
        elif gap_s:
            time.sleep(gap_s)
        t0 = time.perf_counter()
        pool.submit(call).result() if how == "thread" else call()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times[30:]) * 1e3, 3)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", type=Path, required=True, help="exported on the GPU (packed fp16 graph)")
    p.add_argument("--padded-artifact", type=Path, help="the same model exported with --keep-padding")
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    from app.batcher import collate
    from app.engine import OrtEngine
    from app.tokenization import TextTokenizer
    from artifact.manifest import CLS_EMBEDDING, TOKENIZER_FILE, read_manifest
    from artifact.session import kernels_library
    from bench.engine_throughput import DeviceBoundSession

    manifest = read_manifest(args.artifact)
    tokenizer = TextTokenizer(args.artifact / TOKENIZER_FILE, manifest.max_length, 10**6, manifest.special_tokens)
    short = tokenizer.encode_batch([SHORT_TEXT], truncate=True).sequences
    results = {}
    variants = {"packed, kernels on": ("on", "off"), "packed, kernels off": ("off", "off")}
    if manifest.graph("fp16").host_packed or manifest.graph("fp16").padded:  # the server's engine
        variants["server engine: kernels on, CUDA graphs"] = ("on", "on")
    for label, (kernels, cuda_graphs) in variants.items():
        engine = OrtEngine(args.artifact, manifest, "cuda", "fp16", kernels=kernels, cuda_graphs=cuda_graphs)
        batch = collate(short, engine.pad_id, frozenset({CLS_EMBEDDING}))
        for _ in range(50):
            engine.run(batch)
        call = lambda: engine.run(batch)  # noqa: E731
        results[label] = {
            "back_to_back": median_ms(call, 0), "sleep_2ms": median_ms(call, 0.002),
            "spin_2ms": median_ms(call, 0.002, "spin"), "thread_sleep_2ms": median_ms(call, 0.002, "thread"),
            "sleep_10ms": median_ms(call, 0.010)}
        print(f"{label}: {results[label]}", flush=True)
    if args.padded_artifact:
        graph = read_manifest(args.padded_artifact).graph("fp16")
        engine = DeviceBoundSession(args.padded_artifact / graph.custom_kernels.file, "cuda", cuda_graph=True,
                                    kernels_library=kernels_library("on", "cuda"))
        feed = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
                "token_type_ids": batch.token_type_ids}
        prepared = engine.prepare(feed)
        cls_value = prepared[1][3 + [o.name for o in engine.session.get_outputs()].index(CLS_EMBEDDING)]
        for _ in range(20):  # the first run captures the graph
            engine.run(prepared)

        def replay() -> None:  # replay, then read the [CLS] vector back as the server would
            engine.run(prepared)
            cls_value.numpy()

        results["padded + kernels, CUDA graph"] = {"back_to_back": median_ms(replay, 0),
                                                   "sleep_2ms": median_ms(replay, 0.002),
                                                   "sleep_10ms": median_ms(replay, 0.010)}
        print(f"padded + kernels, CUDA graph: {results['padded + kernels, CUDA graph']}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
