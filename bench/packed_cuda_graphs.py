"""The host-packed graph replayed as CUDA graphs (what the server runs for a packed artifact) against the
packed graph run as it is, and the padded fused-ORT graph at batch 256 x 128.

    python bench/packed_cuda_graphs.py --artifact ART [--padded-artifact PADDED] [--out FILE.json]

ART: exported with `python -m export --device cuda` (custom kernels built); PADDED: the same model exported
with --keep-padding --custom-kernels off --no-cuda-graphs (fused ORT's padded graph). For batches of real
text and full-length batches: the largest difference between the two engines' outputs, and ms per batch
end to end (OrtEngine.run: copies in, run, copies out), on the packed graph and as the server runs it by
default (on the lane's own thread: replayed within the default buckets; past them uncaptured there, or on
the packed graph for a model that pools the mean), uncaptured whatever its size, and the replay alone with
its inputs already on the device. Also the start-up time and GPU memory of capturing every bucket up to
4,096, 16,384 and 32,768 tokens.
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
from app.cuda_graphs import PACKED_SHORT_WIDTHS, default_replay_tokens  # noqa: E402
from app.engine import Batch, OrtEngine  # noqa: E402
from app.tokenization import TextTokenizer  # noqa: E402
from artifact.manifest import (CLS_EMBEDDING, INPUT_NAMES, NSP_LOGITS, POOLED_EMBEDDING,  # noqa: E402
                               TOKENIZER_FILE, read_manifest)
from artifact.session import open_session  # noqa: E402
from bench.engine_throughput import fixed_batch  # noqa: E402
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
    return collate(Sequences.concat([e.ids for e in encoded], [e.type_ids for e in encoded]), pad_id, outputs)


def full_batch(rows: int, length: int, vocab: int, outputs: frozenset) -> Batch:
    return Batch(**fixed_batch(rows, length, np.random.default_rng(0), vocab), outputs=tuple(sorted(outputs)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, required=True)
    parser.add_argument("--padded-artifact", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--short-lengths", default=",".join(map(str, PACKED_SHORT_WIDTHS)),
                        help="the server's cuda_graph_short_lengths (default: its default); '' for none")
    args = parser.parse_args()
    short = tuple(int(n) for n in args.short_lengths.split(",") if n)
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
    default = default_replay_tokens(manifest.graph("fp16").host_packed.outputs)  # the server's, for this model
    for tokens in (4096, 16384, 32768):  # up to 256 x 128
        before, t = gpu_memory_mib(), time.perf_counter()
        engines[tokens] = OrtEngine(art, manifest, "cuda", "fp16", cuda_graphs="on", cuda_graph_tokens=tokens,
                                    cuda_graph_short_lengths=short)
        capture = {"cuda_graph_tokens": tokens, "buckets": len(engines[tokens].packed_lanes[0].buckets),
                   "seconds": round(time.perf_counter() - t, 2), "gpu_mib_added": gpu_memory_mib() - before}
        result["capture"].append(capture)
        print("capture", capture, flush=True)

    texts = make_texts(4000, seed=3)
    cases = {f"{n} texts": text_batch(tokenizer, texts[i * 7:i * 7 + n], pad, outputs)
             for i, n in enumerate((1, 8, 16, 40, 64, 128, 256))}
    cases["one long text among 40"] = text_batch(tokenizer, texts[500:539] + [" ".join(texts[600:640])], pad, outputs)
    cases["16 x 128"] = full_batch(16, 128, manifest.vocab_size, outputs)
    cases["128 x 128"] = full_batch(128, 128, manifest.vocab_size, outputs)
    cases["256 x 128"] = full_batch(256, 128, manifest.vocab_size, outputs)
    rows = []
    for name, batch in cases.items():
        ids, types, lengths = batch.unpadded()
        tokens = int(lengths.sum())
        # as the server runs it by default: replayed within the buckets, uncaptured past them
        served = engines[default]
        replays = served.packed_lanes[0]
        want, got = packed.run(batch), served.run(batch)
        a, b = got[CLS_EMBEDDING], want[CLS_EMBEDDING]
        key = replays.bucket(len(lengths), tokens, int(lengths.max()))
        on_lane = lambda fn: replays.thread.submit(median_ms, fn, args.iters).result()  # noqa: E731
        row = {"case": name, "rows": len(lengths), "tokens": tokens, "bucket": key,
               "max_abs_diff": max(float(np.abs(got[k] - want[k]).max()) for k in batch.outputs),
               "min_cos_cls": float((np.sum(a * b, 1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min()),
               "packed_ms": median_ms(lambda: packed.run(batch), args.iters),
               "served_ms": on_lane(lambda: served.run(batch)),
               "uncaptured_ms": on_lane(lambda: replays._run_uncaptured(lengths, ids, types, tuple(batch.outputs)))}
        if key is not None:
            bucket = replays._graphs[key]
            row["replay_device_ms"] = on_lane(lambda: replays.session.run_with_iobinding(bucket.binding,
                                                                                         bucket.run_options))
        if name == "256 x 128":
            row["packed_device_ms"] = device_ms(packed.session, batch, args.iters)
            if args.padded_artifact:
                padded_manifest = read_manifest(args.padded_artifact)
                padded = open_session(args.padded_artifact / padded_manifest.graph("fp16").file, "cuda")
                row["padded_fused_ort_device_ms"] = device_ms(padded, batch, args.iters)
        rows.append(row)
        print(json.dumps(row), flush=True)
    result["cases"] = rows
    result["lanes"] = lanes_throughput(art, manifest, cases["40 texts"], args.iters)
    replays = engines[default].packed_lanes[0]
    result["host_stages_40_texts"] = replays.thread.submit(host_stages, replays, cases["40 texts"], args.iters).result()
    print("lanes", result["lanes"], "\nhost stages (ms)", result["host_stages_40_texts"], flush=True)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    return 0


def lanes_throughput(art: Path, manifest, batch: Batch, iters: int) -> list[dict]:
    """Batches per second of `batch` back to back, through 1 and 2 sessions replaying side by side
    (cuda_graph_lanes), each lane fed by its own thread as the batcher's claims would."""
    engine = OrtEngine(art, manifest, "cuda", "fp16", cuda_graphs="on", cuda_graph_lanes=2)
    ids, types, lengths = batch.unpadded()
    out = []
    for lanes in (1, 2, 1, 2):
        count = 20 * iters
        started = time.perf_counter()
        futures = [engine.packed_lanes[i % lanes].thread.submit(engine.run, batch) for i in range(count)]
        for f in futures:
            f.result()
        seconds = time.perf_counter() - started
        out.append({"lanes": lanes, "batches_per_s": round(count / seconds, 1),
                    "texts_per_s": round(count * len(lengths) / seconds)})
    return out


def host_stages(replays, batch: Batch, iters: int) -> dict[str, float]:
    """Median ms of each step of one replay (called on the lane's own thread): packing, the input copy (one,
    of the bucket's flat array), the replay, the output copy."""
    from app.cuda_graphs import FLAT_INPUTS
    from artifact.host_packing import HostPacker

    ids, types, lengths = batch.unpadded()
    key = replays.bucket(len(lengths), int(lengths.sum()), int(lengths.max()))
    bucket = replays._graphs[key]
    rows, _, width = key
    packer = HostPacker(rows, width)  # as the lane packs: into arrays reused batch to batch
    packer.pack(lengths, ids, types, bucket.length, replays.pad_id)
    flat = packer.flat(bucket.length)
    return {"collate": median_ms(lambda: collate(Sequences(ids, types, lengths), 0, frozenset(batch.outputs)), iters),
            "pack": median_ms(lambda: packer.pack(lengths, ids, types, bucket.length, replays.pad_id), iters),
            "copy_in": median_ms(lambda: bucket.inputs[FLAT_INPUTS].update_inplace(flat), iters),
            "replay": median_ms(lambda: replays.session.run_with_iobinding(bucket.binding, bucket.run_options), iters),
            "copy_out_cls": median_ms(lambda: bucket.outputs[CLS_EMBEDDING].numpy(), iters)}


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
