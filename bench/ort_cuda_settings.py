"""Which ONNX Runtime CUDA graph forms and settings move fp16 BERT-base throughput at length 128.

  python bench/ort_cuda_settings.py build              # random-weight base model, traced once, fused 4 ways
  python bench/ort_cuda_settings.py run GRAPH [JSON]   # batch 32 and 256 seq/s (IO binding), CUDA options JSON
  python bench/ort_cuda_settings.py profile GRAPH      # plus ORT's per-operator profile (host-side times)

Graphs (all fp16 inside, float32 / int64 at the boundary, as the export makes them):
  attention  Attention op, 1-D mask index (ORT's default for BERT; what `python -m export` ships)
  rawmask    Attention op reading the raw 2-D mask
  mha        MultiHeadAttention op (separate Q/K/V projections) with a key padding mask
  nomask     Attention with no mask at all: wrong on padded rows, an upper bound only
Environment variables (ORT_DISABLE_*_ATTENTION, ORT_ENABLE_CUDNN_FLASH_ATTENTION, ORT_CUDA_GEMM_OPTIONS)
are read per process: `bench/gpu_suite.sh ortsettings` runs each variant in its own process.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

WORK = Path("/tmp/explore")
GRAPHS = ("attention", "rawmask", "mha", "nomask")


def build() -> None:
    import torch
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    from bench.make_base_model import main as make_base_model
    from export.onnx_graph import EmbeddingGraph, trace_to_onnx
    from training.model_folder import load_model_folder

    make_base_model(WORK)
    loaded = load_model_folder(WORK / "model")
    traced = WORK / "traced.onnx"
    with torch.no_grad():
        trace_to_onnx(EmbeddingGraph(loaded.model, True, True).eval(), traced)
    for name in GRAPHS:
        opts = FusionOptions("bert")
        if name == "rawmask":
            opts.use_raw_attention_mask(True)
        elif name == "mha":
            opts.use_multi_head_attention = True
            opts.use_raw_attention_mask(True)
        elif name == "nomask":
            opts.disable_attention_mask()
        opt = optimizer.optimize_model(str(traced), model_type="bert", num_heads=12, hidden_size=768, opt_level=1,
                                       use_gpu=True, optimization_options=opts)
        fused = {k: v for k, v in opt.get_fused_operator_statistics().items() if v}
        opt.convert_float_to_float16(keep_io_types=True)
        opt.save_model_to_file(str(WORK / f"{name}.onnx"))
        print(name, fused, flush=True)


def measure(graph: str, provider_opts: dict, profile: bool = False) -> dict:
    import onnxruntime as ort

    ort.preload_dlls()
    so = ort.SessionOptions()
    if profile:
        so.enable_profiling = True
        so.profile_file_prefix = "/tmp/ortprof"
    s = ort.InferenceSession(str(WORK / f"{graph}.onnx"), so, providers=[("CUDAExecutionProvider", provider_opts)])
    res: dict = {}
    rng = np.random.default_rng(0)
    for b in (32, 256):
        ids = rng.integers(1000, 1900, (b, 128)).astype(np.int64)
        feed = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}
        io = s.io_binding()
        keep = []
        for k in (i.name for i in s.get_inputs()):
            value = ort.OrtValue.ortvalue_from_numpy(feed[k], "cuda", 0)
            keep.append(value)
            io.bind_ortvalue_input(k, value)
        for o in s.get_outputs():
            io.bind_output(o.name, "cuda")
        for _ in range(5):
            s.run_with_iobinding(io)
        n = 5 if profile else 30
        t = time.perf_counter()
        for _ in range(n):
            s.run_with_iobinding(io)
        res[b] = round(b * n / (time.perf_counter() - t))
    if profile:
        events = json.load(open(s.end_profiling()))
        per_op: dict[str, float] = {}
        for e in events:
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
                op = e["args"].get("op_name", "?")
                per_op[op] = per_op.get(op, 0) + e["dur"]
        total = sum(per_op.values())
        res["profile_top"] = sorted(((k, round(v / total, 3)) for k, v in per_op.items()), key=lambda x: -x[1])[:8]
    return res


if __name__ == "__main__":
    if sys.argv[1] == "build":
        WORK.mkdir(parents=True, exist_ok=True)
        build()
    else:
        graph = sys.argv[2]
        opts = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
        env = " ".join(f"{k}={v}" for k, v in os.environ.items() if k.startswith("ORT_"))
        print(f"{graph:10s} {json.dumps(opts) if opts else '':60s} {env:40s} seq/s",
              measure(graph, opts, profile=sys.argv[1] == "profile"), flush=True)
