"""The [CLS]-rows variant of an artifact's padded CPU graphs (fp32 and int8; export writes it as
model_cls_rows.onnx / model_int8_cls_rows.onnx, export.last_layer_rows.padded_for_cls_rows), made again
here from the full graphs: its parity against the full graph and its speed on the server's CPU session
options.

The padded CPU graph ([batch, length, hidden]) reads the [CLS] vector as Gather(axis=1, index 0) of the last
hidden state. The variant gathers the tensors that enter the region after the last attention (its output
and the residual) at position 0 with Gather(axis=1, indices=[0]) (1-D, so they stay [B, 1, H]): the last
layer's output product, feed-forward block and LayerNorms run on one row per sequence. The outputs that need
every token (token_embeddings, mean_embedding) are dropped.

    python bench/cpu_cls_rows.py --artifact ARTIFACT [--gate MODEL_DIR] [--threads 1] [--parity-only] [--json OUT]

Findings (2-core VM, quiet, 1 intra-op thread as the server's CPU engine there): the variant saves 34-39% of a
batch for the default model (2 x 128), 8-12% for all-MiniLM-L6-v2 and 4.4-7.1% for a BERT-base-shaped model
(the FLOP count says 35%, 12%, 6%); fp32 outputs are bit-identical; int8 moves by about as much as its own
row-alone vs row-in-a-batch difference (DynamicQuantizeLinear scales per tensor) and passes the export gate.
A second session costs about the graph's size again (BERT-base: +434 MB fp32, +122 MB int8).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from artifact.session import open_session  # noqa: E402
from export.last_layer_rows import ATTENTION, padded_for_cls_rows  # noqa: E402
from export.parity import text_batches  # noqa: E402
from export.sentences import CALIBRATION_SENTENCES, SENTENCES  # noqa: E402

CLS_OUTPUTS = ("cls_embedding", "pooled_embedding", "nsp_logits")


def tail_after_last_attention(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    nodes = list(model.graph.node)
    last = max(i for i, n in enumerate(nodes) if n.op_type in ATTENTION)
    return nodes[last:]


# ---------------------------------------------------------------- inputs

def _specials(manifest: dict) -> tuple[int, int, int]:
    s = manifest["special_tokens"]
    return s["[CLS]"], s["[SEP]"], s["[PAD]"]


def parity_batches(tokenizer: Tokenizer, manifest: dict) -> list[dict[str, np.ndarray]]:
    """Real text, mixed lengths: the export gate's sentence batches (8 rows, a batch of pairs), plus all the
    sentences and the calibration ones in one batch of 72 (the per-tensor int8 scale over many rows)."""
    _, _, pad = _specials(manifest)
    length = manifest["max_length"]
    batches = text_batches(tokenizer, SENTENCES, length, pad)
    batches += text_batches(tokenizer, SENTENCES + CALIBRATION_SENTENCES, length, pad, batch_size=72)
    return batches


def timing_batch(tokenizer: Tokenizer, manifest: dict, rows: int, length: int, offset: int = 0) -> dict:
    """`rows` texts of exactly `length` tokens: [CLS], consecutive word pieces of the sentences, [SEP]."""
    cls, sep, _ = _specials(manifest)
    stream = [i for s in SENTENCES + CALIBRATION_SENTENCES for i in tokenizer.encode(s, add_special_tokens=False).ids]
    body = length - 2
    ids = np.empty((rows, length), dtype=np.int64)
    for r in range(rows):
        start = (offset + r * 37) % (len(stream) - body)
        ids[r] = [cls] + stream[start:start + body] + [sep]
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}


# ---------------------------------------------------------------- parity

def _cos_min(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(((a * b).sum(-1) / np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-30)).min())


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def diff(got: dict, want: dict) -> dict:
    out = {}
    for name in got:
        a, b = got[name].astype(np.float64), want[name].astype(np.float64)
        out[f"{name}_max_abs"] = float(np.abs(a - b).max())
        if name == "nsp_logits":
            out["nsp_prob_max_diff"] = float(np.abs(_softmax(a) - _softmax(b)).max())
        else:
            out[f"{name}_min_cos"] = _cos_min(a, b)
    return out


def worst(figures: list[dict]) -> dict:
    merged = {}
    for f in figures:
        for k, v in f.items():
            merged[k] = min(merged.get(k, v), v) if k.endswith("_min_cos") else max(merged.get(k, v), v)
    return merged


def parity(sessions: dict, names: list[str], batches: list[dict]) -> dict:
    runs = {key: [dict(zip(names, s.run(names, b))) for b in batches] for key, s in sessions.items()}
    pairs = {"fp32 variant vs fp32 full": ("fp32_var", "fp32"),
             "int8 full vs fp32 full": ("int8", "fp32"),
             "int8 variant vs fp32 full": ("int8_var", "fp32"),
             "int8 variant vs int8 full": ("int8_var", "int8")}
    report = {label: worst([diff(g, w) for g, w in zip(runs[a], runs[b])])
              for label, (a, b) in pairs.items() if a in runs and b in runs}
    # batch dependence: each row alone against the same row in its batch (the gate's 8-row batches)
    for key in ("fp32", "fp32_var", "int8", "int8_var"):
        if key not in sessions:
            continue
        figs = []
        for b, together in zip(batches[:3], runs[key][:3]):
            for r in range(b["input_ids"].shape[0]):
                n = int(b["attention_mask"][r].sum())
                alone = {k: v[r:r + 1, :n] for k, v in b.items()}
                got = dict(zip(names, sessions[key].run(names, alone)))
                figs.append(diff(got, {k: v[r:r + 1] for k, v in together.items()}))
        report[f"{key}: row alone vs row in its batch"] = worst(figs)
    return report


def export_gate(model_dir: Path, manifest: dict, sessions: dict, names: list[str]) -> dict:
    """The export's own int8 gate (export.pipeline: seeded random batches + SENTENCES, PyTorch fp32 as the
    reference) on the [CLS] outputs, for the full int8 graph and the variant; with the gate's verdict."""
    import torch  # noqa: F401 - only here: the rest of the script is torch-free
    from export.checkpoint_layout import read_layout
    from export.onnx_graph import EmbeddingGraph
    from export.parity import compare, limits
    from export.pipeline import _load_tokenizer, parity_feeds, special_token_ids
    from training.model_folder import load_model_folder

    layout = read_layout(model_dir)
    loaded = load_model_folder(layout.encoder_dir, sequence_classifier=True)
    tokenizer = _load_tokenizer(layout.encoder_dir, loaded.config.vocab_size)
    graph = EmbeddingGraph(loaded.model, loaded.has_pooler, loaded.has_nsp_head, loaded.classifier).eval()
    batches, _ = parity_feeds(tokenizer, special_token_ids(tokenizer), loaded.config.vocab_size,
                              manifest["max_length"])
    report = {}
    for key in ("fp32", "fp32_var", "int8", "int8_var"):
        if key not in sessions:
            continue
        figures = compare(sessions[key], graph, batches, outputs=names)
        precision = key.split("_")[0]
        failed = [f"{n} {v:.4g} (limit {op} {lim})" for n, op, lim in limits(precision, figures)
                  for v in [figures[n]] if not (v <= lim if op == "<=" else v >= lim)]
        report[f"gate {key} vs PyTorch"] = {**figures, "passes": not failed, "failed": failed}
    return report


# ---------------------------------------------------------------- timing

def time_pair(full, variant, names: list[str], feed: dict, budget_s: float) -> dict:
    """Medians of single runs, full and variant alternating (warm-up first): wall time, and the calling
    thread's CPU time, which with one intra-op thread is where ONNX Runtime computes (less sensitive to
    other processes on the cores than wall time)."""
    for _ in range(3):
        full.run(names, feed)
        variant.run(names, feed)
    t0 = time.perf_counter()
    full.run(names, feed)
    one = time.perf_counter() - t0
    repeats = int(max(9, min(201, budget_s / (2 * one))))
    wall = {"full": [], "variant": []}
    cpu = {"full": [], "variant": []}
    for i in range(repeats):
        order = (("full", full), ("variant", variant)) if i % 2 == 0 else (("variant", variant), ("full", full))
        for key, s in order:
            c0, t0 = time.thread_time(), time.perf_counter()
            s.run(names, feed)
            wall[key].append(time.perf_counter() - t0)
            cpu[key].append(time.thread_time() - c0)
    out = {"repeats": repeats}
    for label, times in (("wall", wall), ("cpu", cpu)):
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        out[label] = {"full_ms": med["full"], "variant_ms": med["variant"],
                      "saving_pct": 100 * (1 - med["variant"] / med["full"]),
                      "full_iqr_ms": [float(np.percentile(times["full"], q)) * 1e3 for q in (25, 75)],
                      "variant_iqr_ms": [float(np.percentile(times["variant"], q)) * 1e3 for q in (25, 75)]}
    return out


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--artifact", type=Path, required=True)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads (the server's CPU default: cores // "
                   "inference workers = 1)")
    p.add_argument("--work", type=Path, default=None, help="where the variants are written (default: "
                   ".cache/cls_rows/<artifact name>)")
    p.add_argument("--parity-only", action="store_true")
    p.add_argument("--budget", type=float, default=6.0, help="seconds of timed runs per batch shape and graph")
    p.add_argument("--json", type=Path)
    p.add_argument("--gate", type=Path, help="the model folder the artifact was exported from: also run the "
                   "export's parity gate (PyTorch reference) on the [CLS] outputs")
    args = p.parse_args()

    manifest = json.loads((args.artifact / "manifest.json").read_text())
    tokenizer = Tokenizer.from_file(str(args.artifact / "tokenizer.json"))
    tokenizer.no_truncation()
    tokenizer.no_padding()
    work = args.work or Path(__file__).resolve().parents[1] / ".cache" / "cls_rows" / args.artifact.name
    work.mkdir(parents=True, exist_ok=True)
    result = {"artifact": str(args.artifact), "threads": args.threads, "layers": manifest["num_layers"],
              "hidden": manifest["hidden_size"], "graphs": {}}
    paths = {}
    for precision in ("fp32", "int8"):
        if precision not in manifest["graphs"]:
            continue
        src = args.artifact / manifest["graphs"][precision]["file"]
        model = onnx.load(str(src))
        tail = tail_after_last_attention(model)
        print(f"== {precision} {src.name}: nodes from the last attention on:")
        for n in tail:
            print(f"   {n.op_type:24s} {n.name}")
        variant = padded_for_cls_rows(model)
        if variant is None:
            raise SystemExit(f"{src.name}: not a graph export.last_layer_rows.padded_for_cls_rows cuts")
        dst = work / f"{src.stem}_cls_rows.onnx"
        onnx.save(variant, str(dst))
        info = {"outputs": [o.name for o in variant.graph.output], "nodes": len(variant.graph.node),
                "region": [n.op_type for n in tail_after_last_attention(variant)]}
        print(f"   variant {dst}: nodes from the last attention on {Counter(info['region'])}; outputs {info['outputs']}")
        paths[precision], paths[f"{precision}_var"] = src, dst
        result["graphs"][precision] = {"tail": [n.op_type for n in tail], **info}

    base_rss = rss_mb()
    sessions = {}
    for key, path in paths.items():
        before = rss_mb()
        sessions[key] = open_session(path, "cpu", intra_op_threads=args.threads)
        result.setdefault("session_rss_mb", {})[key] = round(rss_mb() - before, 1)
    result["rss_base_mb"] = round(base_rss, 1)
    names = [n for n in CLS_OUTPUTS if n in {o.name for o in sessions["fp32_var"].get_outputs()}]
    print(f"outputs compared and timed: {names}; session RSS growth MB: {result['session_rss_mb']}")

    rep = parity(sessions, names, parity_batches(tokenizer, manifest))
    if args.gate:
        rep.update(export_gate(args.gate, manifest, sessions, names))
    result["parity"] = rep
    for label, figs in rep.items():
        print(f"  {label:36s} " + ", ".join(f"{k} {v:.6f}" if k.endswith(("cos", "cosine")) else f"{k} {v}"
                                           if not isinstance(v, float) else f"{k} {v:.3g}" for k, v in figs.items()))
    if not args.parity_only:
        shapes = [(1, 40), (8, 40), (32, 40), (8, 128)]
        result["timing"] = {}
        result["load_before"] = os.getloadavg()
        for precision in ("fp32", "int8"):
            if precision not in sessions:
                continue
            for rows, length in shapes:
                if length > manifest["max_length"]:
                    continue
                feed = timing_batch(tokenizer, manifest, rows, length)
                t = time_pair(sessions[precision], sessions[f"{precision}_var"], names, feed, args.budget)
                result["timing"][f"{precision} {rows}x{length}"] = t
                w, c = t["wall"], t["cpu"]
                print(f"  {precision} {rows:2d} x {length:3d}: wall full {w['full_ms']:8.2f} ms variant "
                      f"{w['variant_ms']:8.2f} ms saving {w['saving_pct']:5.1f}% | thread cpu full {c['full_ms']:8.2f} "
                      f"ms variant {c['variant_ms']:8.2f} ms saving {c['saving_pct']:5.1f}% ({t['repeats']} runs each; "
                      f"wall IQR {w['full_iqr_ms'][0]:.2f}-{w['full_iqr_ms'][1]:.2f} / "
                      f"{w['variant_iqr_ms'][0]:.2f}-{w['variant_iqr_ms'][1]:.2f})", flush=True)
    if not args.parity_only:
        result["load_after"] = os.getloadavg()
        print(f"load average before / after timing: {result['load_before']} / {result['load_after']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=float))


if __name__ == "__main__":
    main()
