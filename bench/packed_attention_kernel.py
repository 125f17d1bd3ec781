"""Our attention kernel (bertserve.PackedAttention) against ONNX Runtime's PackedMultiHeadAttention on the
same packed inputs, each as a chain of twelve attention nodes (one per BERT-base layer, the output of one
the query of the next) in its own CUDA session, inputs and outputs bound on the device.

    python bench/packed_attention_kernel.py [--json OUT.json] [--iters 200]

Needs the operator library built with nvcc (bash custom_kernels/build.sh). For each batch shape: ms per
twelve layers (median of --iters runs, each run's launch included, as the served graph pays it) and the
largest difference between the two kernels' outputs.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

import onnx  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

from artifact.session import kernels_library, open_session  # noqa: E402
from custom_kernels import DOMAIN  # noqa: E402
from custom_kernels.fusion import PACKED_ATTENTION  # noqa: E402

HEADS, HEAD_SIZE, LAYERS = 12, 64, 12


def chain(ours: bool) -> onnx.ModelProto:
    nodes, query = [], "q"
    for layer in range(LAYERS):
        out = f"o{layer}"
        if ours:
            nodes.append(helper.make_node(PACKED_ATTENTION, [query, "k", "v", "token_offset", "cu"], [out],
                                          domain=DOMAIN, num_heads=HEADS, head_size=HEAD_SIZE,
                                          scale=HEAD_SIZE ** -0.5))
        else:
            nodes.append(helper.make_node("PackedMultiHeadAttention", [query, "k", "v", "", "token_offset", "cu"],
                                          [out], domain="com.microsoft", num_heads=HEADS))
        query = out
    width = HEADS * HEAD_SIZE
    graph = helper.make_graph(
        nodes, "attention", [helper.make_tensor_value_info(n, TensorProto.FLOAT16, ["T", width]) for n in "qkv"]
        + [helper.make_tensor_value_info("token_offset", TensorProto.INT32, ["B", "S"]),
           helper.make_tensor_value_info("cu", TensorProto.INT32, ["B1"])],
        [helper.make_tensor_value_info(query, TensorProto.FLOAT16, ["T", width])])
    return helper.make_model(graph, ir_version=8, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1), helper.make_opsetid(DOMAIN, 1)])


def feed(lengths: list[int], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Q, K, V of sum(lengths) tokens; cu the cumulative lengths; token_offset each real token's position
    in the padded [B, S] batch, then the padding's, as ORT's packing writes it."""
    batch, width = len(lengths), max(lengths)
    real = [b * width + t for b, n in enumerate(lengths) for t in range(n)]
    pads = sorted(set(range(batch * width)) - set(real))
    q, k, v = (rng.normal(0, 1, (sum(lengths), HEADS * HEAD_SIZE)).astype(np.float16) for _ in range(3))
    return {"q": q, "k": k, "v": v, "token_offset": np.array(real + pads, np.int32).reshape(batch, width),
            "cu": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)}


def timed(session, inputs: dict[str, np.ndarray], iters: int) -> tuple[float, np.ndarray]:
    import onnxruntime as ort

    io = session.io_binding()
    keep = [ort.OrtValue.ortvalue_from_numpy(value, "cuda", 0) for value in inputs.values()]
    for name, value in zip(inputs, keep):
        io.bind_ortvalue_input(name, value)
    io.bind_output(session.get_outputs()[0].name, "cuda")
    for _ in range(5):
        session.run_with_iobinding(io)
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        session.run_with_iobinding(io)  # returns once the stream is done
        times.append(time.perf_counter() - start)
    return float(np.median(times) * 1e3), io.copy_outputs_to_cpu()[0]


def workloads(rng: np.random.Generator) -> dict[str, list[int]]:
    return {
        "256 x 128": [128] * 256,
        "32 x 128": [128] * 32,
        "one text of 40 tokens": [40],
        "48 texts of 30-55 tokens": rng.integers(30, 56, 48).tolist(),
        "128 texts of 16-256 tokens": rng.integers(16, 257, 128).tolist(),
        "64 texts of 300-512 tokens": rng.integers(300, 513, 64).tolist(),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--iters", type=int, default=200)
    args = parser.parse_args(argv)
    library = kernels_library("on", "cuda")
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sessions = {}
        for name, ours in (("ours", True), ("ort", False)):
            path = Path(tmp) / f"{name}.onnx"
            onnx.save(chain(ours), str(path))
            sessions[name] = open_session(path, "cuda", library=library if ours else None)
        for label, lengths in workloads(rng).items():
            inputs = feed(lengths, rng)
            (ours_ms, ours_out), (ort_ms, ort_out) = (timed(sessions[n], inputs, args.iters) for n in ("ours", "ort"))
            a, b = ours_out.astype(np.float64), ort_out.astype(np.float64)
            cosine = (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))
            rows.append({"workload": label, "sequences": len(lengths), "tokens": int(sum(lengths)),
                         "ours_ms": ours_ms, "ort_ms": ort_ms, "speedup": ort_ms / ours_ms,
                         "max_abs_diff": float(np.abs(a - b).max()), "min_cosine": float(cosine.min())})
            print(f"{label:>28}: ours {ours_ms:7.3f} ms  ORT {ort_ms:7.3f} ms  ({ort_ms / ours_ms:4.2f}x)  "
                  f"max |diff| {rows[-1]['max_abs_diff']:.2e}  min cos {rows[-1]['min_cosine']:.6f}", flush=True)
    if args.json:
        card = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True).stdout.strip()
        args.json.write_text(json.dumps({"layers": LAYERS, "heads": HEADS, "head_size": HEAD_SIZE, "device": card,
                                         "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
