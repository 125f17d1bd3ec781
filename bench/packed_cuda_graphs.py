"""The host-packed graph replayed as CUDA graphs (what the server runs for a packed artifact) against the
packed graph run as it is, and the padded fused-ORT graph at batch 256 x 128.

    python bench/packed_cuda_graphs.py --artifact ART [--padded-artifact PADDED] [--out FILE.json]

ART: exported with `python -m export --device cuda` (custom kernels built); PADDED: the same model exported
with --keep-padding --custom-kernels off --no-cuda-graphs (fused ORT's padded graph). For batches of real
text and full-length batches: the largest difference between the two engines' outputs, and ms per batch
end to end (OrtEngine.run: copies in, run, copies out; the replays called on their own thread, as the
server does) and with inputs already on the device. Also the start-up time and GPU memory of capturing
every bucket, for the default batch limits and for batches of up to 32,768 tokens.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from app.batcher import Sequences, collate  # noqa: E402
from app.cuda_graphs import PACKED_MAX_TOKENS  # noqa: E402
from app.engine import Batch, OrtEngine  # noqa: E402
from app.tokenization import TextTokenizer  # noqa: E402
from artifact.manifest import (CLS_EMBEDDING, INPUT_NAMES, NSP_LOGITS, POOLED_EMBEDDING,  # noqa: E402
                               TOKENIZER_FILE, read_manifest)
from artifact.session import open_session  # noqa: E402
from bench.http_load import make_texts  # noqa: E402

def gpu_memory_mib() -> int:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True)
    return int(out.stdout.split()[0]) if out.returncode == 0 else -1


def median_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1000)


def text_batch(tokenizer: TextTokenizer, texts: list[str], pad_id: int, outputs: frozenset) -> Batch:
    encoded = tokenizer.encode(texts, truncate=True)
    ids = np.concatenate([e.ids for e in encoded])
    types = np.concatenate([e.type_ids for e in encoded])
    lengths = np.array([len(e.ids) for e in encoded], np.int64)
    return collate(Sequences(ids, types, lengths), pad_id, outputs)


def full_batch(rows: int, length: int, vocab: int, outputs: frozenset) -> Batch:
    rng = np.random.default_rng(0)
    ids = rng.integers(min(1000, vocab // 2), vocab, (rows, length)).astype(np.int64)
    return Batch(ids, np.ones_like(ids), np.zeros_like(ids), tuple(sorted(outputs)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--padded-artifact", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    import onnxruntime as ort

    ort.preload_dlls()
    art = args.artifact
    manifest = read_manifest(art)
    tokenizer = TextTokenizer(art / TOKENIZER_FILE, manifest.max_length, 100_000, manifest.special_tokens)
    pad = manifest.special_tokens.get("[PAD]", 0)
    outputs = frozenset({CLS_EMBEDDING, POOLED_EMBEDDING, NSP_LOGITS})
    result: dict = {"max_length": manifest.max_length, "capture": []}

    packed = OrtEngine(art, manifest, "cuda", "fp16", cuda_graphs="off")  # the packed graph, run as it is
    engines = {}
    for tokens in (PACKED_MAX_TOKENS, 32768):  # the server's default, and room for 256 x 128
        before, t = gpu_memory_mib(), time.perf_counter()
        engines[tokens] = OrtEngine(art, manifest, "cuda", "fp16", cuda_graphs="on", cuda_graph_tokens=tokens)
        capture = {"cuda_graph_tokens": tokens, "buckets": len(engines[tokens].packed_graphs.buckets),
                   "seconds": round(time.perf_counter() - t, 2), "gpu_mib_added": gpu_memory_mib() - before}
        result["capture"].append(capture)
        print("capture", capture, flush=True)
    served = engines[32768]
    replays = served.packed_graphs

    texts = make_texts(4000, seed=3)
    cases = {f"{n} texts": text_batch(tokenizer, texts[i * 7:i * 7 + n], pad, outputs)
             for i, n in enumerate((1, 8, 16, 40, 64, 128, 256))}
    cases["one long text among 40"] = text_batch(tokenizer, texts[500:539] + [" ".join(texts[600:640])], pad, outputs)
    cases["128 x 128"] = full_batch(128, 128, manifest.vocab_size, outputs)
    cases["256 x 128"] = full_batch(256, 128, manifest.vocab_size, outputs)
    rows = []
    for name, batch in cases.items():
        want, got = packed.run(batch), served.run(batch)
        a, b = got[CLS_EMBEDDING], want[CLS_EMBEDDING]
        ids, types, lengths = batch.unpadded()
        key = replays.bucket(len(lengths), int(lengths.sum()))
        bucket = replays._graphs[key]
        row = {"case": name, "rows": len(lengths), "tokens": int(lengths.sum()), "bucket": key,
               "max_abs_diff": max(float(np.abs(got[k] - want[k]).max()) for k in batch.outputs),
               "min_cos_cls": float((np.sum(a * b, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min()),
               "packed_ms": median_ms(lambda: packed.run(batch), args.iters),
               "replay_ms": replays.thread.submit(median_ms, lambda: served.run(batch), args.iters).result(),
               "replay_device_ms": replays.thread.submit(
                   median_ms, lambda: replays.session.run_with_iobinding(bucket.binding, bucket.run_options),
                   args.iters).result()}
        if name == "256 x 128":
            row["packed_device_ms"] = device_ms(packed.session, batch, args.iters)
            if args.padded_artifact:
                padded_manifest = read_manifest(args.padded_artifact)
                padded = open_session(args.padded_artifact / padded_manifest.graph("fp16").file, "cuda")
                row["padded_fused_ort_device_ms"] = device_ms(padded, batch, args.iters)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result["cases"] = rows
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


def device_ms(session, batch: Batch, iters: int) -> float:
    """ms per run of `session` on `batch` with its inputs already on the device and outputs left there."""
    import onnxruntime as ort

    binding = session.io_binding()
    keep = [ort.OrtValue.ortvalue_from_numpy(getattr(batch, name), "cuda", 0) for name in INPUT_NAMES]
    for name, value in zip(INPUT_NAMES, keep):
        binding.bind_ortvalue_input(name, value)
    for name in batch.outputs:
        binding.bind_output(name, "cuda")
    return median_ms(lambda: session.run_with_iobinding(binding), iters)


if __name__ == "__main__":
    sys.exit(main())
