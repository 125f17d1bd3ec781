"""ONNX Runtime's own profile of the graph the server runs on a GPU: the CPU time of each node's launch
(ORT's profiler times a CUDA node's Compute call on the host, which is its launch unless it waits for the
GPU), per run, against the whole run's wall time. Where a small batch's ~1-2 ms on the host goes.

  python bench/engine_node_profile.py ART --rows 1,16,40,256 --runs 200

Batches are the server's: real-text-like texts tokenised by the artifact's tokenizer, collated as the
batcher does, run with IO binding (inputs from the host, the cls vector copied back).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import onnxruntime as ort  # noqa: E402

from app.batcher import Sequences, collate  # noqa: E402
from app.tokenization import TextTokenizer  # noqa: E402
from artifact.manifest import CLS_EMBEDDING, TOKENIZER_FILE, read_manifest  # noqa: E402
from artifact.session import CUDA  # noqa: E402
from bench.http_load import make_texts  # noqa: E402
import custom_kernels  # noqa: E402


def profile(path: Path, library: Path | None, batches: dict[int, object], runs: int, device: str = "cuda") -> dict:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3
    if library is not None:
        options.register_custom_ops_library(str(library))
    options.enable_profiling = True
    options.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "ort")
    providers = [(CUDA, {"device_id": "0"})] if device == "cuda" else ["CPUExecutionProvider"]
    session = ort.InferenceSession(str(path), options, providers=providers)
    marks = []  # (rows, wall seconds) per timed run, in order
    for rows, batch in batches.items():
        for i in range(runs + 20):
            binding = session.io_binding()
            for name, value in (("input_ids", batch.input_ids), ("attention_mask", batch.attention_mask),
                                ("token_type_ids", batch.token_type_ids)):
                binding.bind_cpu_input(name, value)
            binding.bind_output(CLS_EMBEDDING, device, 0)
            started = time.perf_counter()
            session.run_with_iobinding(binding)
            binding.copy_outputs_to_cpu()
            if i >= 20:
                marks.append((rows, time.perf_counter() - started))
    events = json.loads(Path(session.end_profiling()).read_text())
    # ORT records one model_run per run; the node events between two model_runs' ends belong to the later one
    runs_seen = [e for e in events if e.get("name") == "model_run"]
    nodes = [e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")]
    ends = [r["ts"] + r["dur"] for r in runs_seen]
    per_rows: dict[int, dict] = {}
    order = [rows for rows in batches for _ in range(runs + 20)]
    node_index = 0
    nodes.sort(key=lambda e: e["ts"])
    for k, (rows, end) in enumerate(zip(order, ends)):
        taken = []
        while node_index < len(nodes) and nodes[node_index]["ts"] <= end:
            taken.append(nodes[node_index])
            node_index += 1
        if k % (runs + 20) < 20:
            continue
        entry = per_rows.setdefault(rows, {"runs": 0, "model_run_us": 0.0, "nodes": collections.Counter(),
                                           "node_us": collections.Counter(), "providers": {}})
        entry["runs"] += 1
        entry["model_run_us"] += runs_seen[k]["dur"]
        for e in taken:
            op = e["args"].get("op_name", "?")
            entry["nodes"][op] += 1
            entry["node_us"][op] += e["dur"]
            entry["providers"][op] = e["args"].get("provider", "?")
    result = {}
    for rows, entry in per_rows.items():
        n = entry["runs"]
        walls = sorted(w for r, w in marks if r == rows)
        ops = sorted(entry["node_us"], key=entry["node_us"].get, reverse=True)
        result[rows] = {
            "wall_ms_p50": round(1e3 * walls[len(walls) // 2], 3),
            "model_run_us": round(entry["model_run_us"] / n, 1),
            "nodes_us": round(sum(entry["node_us"].values()) / n, 1),
            "nodes_per_run": round(sum(entry["nodes"].values()) / n, 1),
            "by_op": {op: {"per_run": round(entry["nodes"][op] / n, 1), "us": round(entry["node_us"][op] / n, 1),
                           "provider": entry["providers"][op]} for op in ops},
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--rows", default="1,16,40,256")
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--kernels", choices=["on", "off"], default="on")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: the fp32 graph (a check of this script)")
    args = parser.parse_args()
    manifest = read_manifest(args.artifact)
    if args.device == "cuda":
        ort.preload_dlls()
    graph = manifest.graph("fp16" if args.device == "cuda" else "fp32")
    library = custom_kernels.library_for("on") if args.kernels == "on" and args.device == "cuda" else None
    path = args.artifact / (graph.custom_kernels.file if library is not None else graph.file)
    tokenizer = TextTokenizer(args.artifact / TOKENIZER_FILE, manifest.max_length, 2_000_000, manifest.special_tokens)
    texts = make_texts(1024, 0)
    pad = manifest.special_tokens.get("[PAD]", 0)
    batches = {}
    for rows in (int(r) for r in args.rows.split(",")):
        enc = tokenizer.encode(texts[:rows], truncate=True)
        batches[rows] = collate(Sequences.concat([e.ids for e in enc], [e.type_ids for e in enc]), pad,
                                frozenset({CLS_EMBEDDING}))
    result = profile(path, library, batches, args.runs, args.device)
    print(f"{path.name}; per run, µs of host time in each op's nodes (ORT's profiler), then the run's own")
    for rows, r in result.items():
        print(f"== {rows} texts: wall p50 {r['wall_ms_p50']} ms; model_run {r['model_run_us']} µs; nodes "
              f"{r['nodes_us']} µs over {r['nodes_per_run']} nodes")
        for op, o in list(r["by_op"].items())[:14]:
            print(f"   {o['us']:8.1f} µs  {o['per_run']:5.1f} x {op} ({o['provider']})")
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "engine_node_profile.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
