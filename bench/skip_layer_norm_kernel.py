"""The residual + LayerNorm after each attention and feed-forward block, three ways, on the GPU:
ORT's MatMul + SkipLayerNormalization, our MatMulBias + ORT's SkipLayerNormalization, and our
MatMulSkipLayerNorm (the product adds the skip as cuBLASLt's C, then our LayerNorm in place). Each graph
chains 12 such nodes (each one's output the next one's skip), fp16, inputs and outputs on the device.

  python bench/skip_layer_norm_kernel.py            # GPU machine, library built (custom_kernels/build.sh)

BERTSERVE_KERNELS_AUTOTUNE_LOG=1 prints what the operator's autotuning timed.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from artifact.session import kernels_library, open_session  # noqa: E402
from custom_kernels import DOMAIN  # noqa: E402

LAYERS = 12


def chain(variant: str, k: int, n: int, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    init, nodes, skip = [], [], "skip0"
    for i in range(LAYERS):
        names = {f"w{i}": rng.normal(0, k ** -0.5, (k, n)), f"bias{i}": rng.normal(0, 1, n),
                 f"gamma{i}": rng.normal(1, 0.2, n), f"beta{i}": rng.normal(0, 0.2, n)}
        init += [numpy_helper.from_array(v.astype(np.float16), name) for name, v in names.items()]
        out = f"y{i}"
        if variant == "ort":
            nodes += [helper.make_node("MatMul", ["x", f"w{i}"], [f"mm{i}"]),
                      helper.make_node("SkipLayerNormalization", [f"mm{i}", skip, f"gamma{i}", f"beta{i}", f"bias{i}"],
                                       [out], domain="com.microsoft", epsilon=1e-12)]
        elif variant == "ours-bias+ort-ln":
            nodes += [helper.make_node("MatMulBias", ["x", f"w{i}", f"bias{i}"], [f"mm{i}"], domain=DOMAIN),
                      helper.make_node("SkipLayerNormalization", [f"mm{i}", skip, f"gamma{i}", f"beta{i}"],
                                       [out], domain="com.microsoft", epsilon=1e-12)]
        else:
            nodes.append(helper.make_node("MatMulSkipLayerNorm", ["x", f"w{i}", f"bias{i}", skip, f"gamma{i}",
                                                                   f"beta{i}"], [out], domain=DOMAIN, epsilon=1e-12))
        skip = out
    graph = helper.make_graph(nodes, variant, [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["M", k]),
                                               helper.make_tensor_value_info("skip0", TensorProto.FLOAT16, ["M", n])],
                              [helper.make_tensor_value_info(skip, TensorProto.FLOAT16, ["M", n])], init)
    return helper.make_model(graph, ir_version=8, opset_imports=[helper.make_opsetid("", 17),
                                                                 helper.make_opsetid("com.microsoft", 1),
                                                                 helper.make_opsetid(DOMAIN, 1)])


def per_node_us(session, feed: dict, runs: int = 30) -> tuple[float, np.ndarray]:
    import onnxruntime as ort

    io = session.io_binding()
    keep = {name: ort.OrtValue.ortvalue_from_numpy(v, "cuda", 0) for name, v in feed.items()}
    for name, v in keep.items():
        io.bind_ortvalue_input(name, v)
    io.bind_output(session.get_outputs()[0].name, "cuda")
    for _ in range(5):
        session.run_with_iobinding(io)
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        session.run_with_iobinding(io)
        times.append(time.perf_counter() - t)
    return 1e6 * float(np.median(times)) / LAYERS, io.copy_outputs_to_cpu()[0]


def main() -> int:
    library = kernels_library("on", "cuda")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for m in (4096, 32768):
            for k, n in ((768, 768), (3072, 768)):
                rng = np.random.default_rng(1)
                feed = {"x": rng.normal(0, 1, (m, k)).astype(np.float16),
                        "skip0": rng.normal(0, 1, (m, n)).astype(np.float16)}
                outs = {}
                for variant in ("ort", "ours-bias+ort-ln", "ours"):
                    path = Path(tmp) / f"{variant}-{m}-{k}.onnx"
                    onnx.save(chain(variant, k, n), str(path))
                    us, outs[variant] = per_node_us(open_session(path, "cuda", library=library), feed)
                    rows.append({"M": m, "K": k, "N": n, "variant": variant, "us_per_node": us})
                    diff = float(np.abs(outs[variant].astype(np.float32) - outs["ort"].astype(np.float32)).max())
                    print(f"M={m:<6} K={k:<5} N={n}  {variant:<18} {us:8.1f} us a node  max |diff| vs ort {diff:.3g}",
                          flush=True)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "skip_layer_norm_kernel.json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
