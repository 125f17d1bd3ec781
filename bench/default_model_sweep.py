"""Which settings should the `make run` default model train with? Runs `python -m training.pretrain` once per
candidate, several at a time, and tabulates held-out MLM / NSP accuracy (quality depends on the steps and
batches, not on the machine, so a GPU or a many-core host finds the candidates; their time on 2 CPU cores
is measured separately with `--time-steps`).

    python bench/default_model_sweep.py --corpus DOCSTRINGS.jsonl --out OUT --device cuda --parallel 8
    python bench/default_model_sweep.py --corpus ... --out OUT --device cpu --parallel 1 --time-steps 60
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from training.data import DataConfig, prepare_data  # noqa: E402

CANDIDATES: dict[str, list[str]] = {
    "default": [],
    "seq64-b64": ["--max-seq-len", "64", "--batch-size", "64"],
    "seq64-b64-v4k": ["--max-seq-len", "64", "--batch-size", "64", "--vocab-size", "4096"],
    "seq64-b64-v4k-lr4e-3": ["--max-seq-len", "64", "--batch-size", "64", "--vocab-size", "4096", "--lr", "4e-3"],
    "seq64-b32-v4k-2400": ["--max-seq-len", "64", "--batch-size", "32", "--vocab-size", "4096", "--max-steps", "2400"],
    "seq128-v4k": ["--vocab-size", "4096"],
    "seq64-b64-v4k-mini": ["--max-seq-len", "64", "--batch-size", "64", "--vocab-size", "4096", "--preset", "mini"],
    "seq64-b128-v4k": ["--max-seq-len", "64", "--batch-size", "128", "--vocab-size", "4096"],
    "seq64-b128-v4k-lr3e-3": ["--max-seq-len", "64", "--batch-size", "128", "--vocab-size", "4096", "--lr", "3e-3"],
    "seq64-b128-v4k-mini": ["--max-seq-len", "64", "--batch-size", "128", "--vocab-size", "4096", "--preset", "mini"],
    "seq64-b64-v4k-mini-2400": ["--max-seq-len", "64", "--batch-size", "64", "--vocab-size", "4096", "--preset", "mini",
                                "--max-steps", "2400"],
    "seq64-b128-v4k-2400": ["--max-seq-len", "64", "--batch-size", "128", "--vocab-size", "4096", "--max-steps", "2400"],
    "seq64-b128-v4k-4800": ["--max-seq-len", "64", "--batch-size", "128", "--vocab-size", "4096", "--max-steps", "4800"],
    "seq64-b128-v4k-mini-4800": ["--max-seq-len", "64", "--batch-size", "128", "--vocab-size", "4096", "--preset", "mini",
                                 "--max-steps", "4800"],
    "seq64-b256-v4k-mini": ["--max-seq-len", "64", "--batch-size", "256", "--vocab-size", "4096", "--preset", "mini"],
    "seq64-b64-v4k-small": ["--max-seq-len", "64", "--batch-size", "64", "--vocab-size", "4096", "--preset", "small"],
    # Learning rate and warm-up: the first sweeps sat at the most-frequent-token accuracy for most of their steps.
    "t64-b64-lr1e-3": ["--max-seq-len", "64", "--batch-size", "64", "--vocab-size", "4096", "--lr", "1e-3"],
    "t64-b64-lr5e-4": ["--max-seq-len", "64", "--batch-size", "64", "--vocab-size", "4096", "--lr", "5e-4"],
    "t64-b64-lr2e-3-w20": ["--max-seq-len", "64", "--batch-size", "64", "--vocab-size", "4096", "--warmup-fraction", "0.2"],
    "t64-b64-lr1e-3-w20": ["--max-seq-len", "64", "--batch-size", "64", "--vocab-size", "4096", "--lr", "1e-3",
                           "--warmup-fraction", "0.2"],
    "t64-b64-lr1e-3-w0": ["--max-seq-len", "64", "--batch-size", "64", "--vocab-size", "4096", "--lr", "1e-3",
                          "--warmup-steps", "0"],
    "t64-b128-lr1e-3": ["--max-seq-len", "64", "--batch-size", "128", "--vocab-size", "4096", "--lr", "1e-3"],
    "t64-b32-lr1e-3-2400": ["--max-seq-len", "64", "--batch-size", "32", "--vocab-size", "4096", "--lr", "1e-3",
                            "--max-steps", "2400"],
    "mini64-b32-lr1e-3": ["--max-seq-len", "64", "--batch-size", "32", "--vocab-size", "4096", "--preset", "mini",
                          "--lr", "1e-3"],
    "mini64-b32-lr5e-4": ["--max-seq-len", "64", "--batch-size", "32", "--vocab-size", "4096", "--preset", "mini",
                          "--lr", "5e-4"],
    "t64-b64-lr1e-3-v8k": ["--max-seq-len", "64", "--batch-size", "64", "--lr", "1e-3"],
    # Larger batches left the plateau sooner: fewer, bigger steps in the same time.
    "t64-b128-1400": ["--max-seq-len", "64", "--batch-size", "128", "--vocab-size", "4096", "--max-steps", "1400"],
    "t64-b128-1600": ["--max-seq-len", "64", "--batch-size", "128", "--vocab-size", "4096", "--max-steps", "1600"],
    "t64-b192-1000": ["--max-seq-len", "64", "--batch-size", "192", "--vocab-size", "4096", "--max-steps", "1000"],
    "t64-b256-800": ["--max-seq-len", "64", "--batch-size", "256", "--vocab-size", "4096", "--max-steps", "800"],
    "t64-b256-1000": ["--max-seq-len", "64", "--batch-size", "256", "--vocab-size", "4096", "--max-steps", "1000"],
    "t64-b256-800-lr3e-3": ["--max-seq-len", "64", "--batch-size", "256", "--vocab-size", "4096", "--max-steps", "800",
                            "--lr", "3e-3"],
    "t64-b256-800-w20": ["--max-seq-len", "64", "--batch-size", "256", "--vocab-size", "4096", "--max-steps", "800",
                         "--warmup-fraction", "0.2"],
    "t64-b512-500": ["--max-seq-len", "64", "--batch-size", "512", "--vocab-size", "4096", "--max-steps", "500"],
    "t48-b256-1000": ["--max-seq-len", "48", "--batch-size", "256", "--vocab-size", "4096", "--max-steps", "1000"],
    "t48-b256-850": ["--max-seq-len", "48", "--batch-size", "256", "--vocab-size", "4096", "--max-steps", "850"],
    "t48-b256-850-v2k": ["--max-seq-len", "48", "--batch-size", "256", "--vocab-size", "2048", "--max-steps", "850"],
    "t40-b320-850": ["--max-seq-len", "40", "--batch-size", "320", "--vocab-size", "4096", "--max-steps", "850"],
    "t32-b384-850": ["--max-seq-len", "32", "--batch-size", "384", "--vocab-size", "4096", "--max-steps", "850"],
    "t48-b192-1100": ["--max-seq-len", "48", "--batch-size", "192", "--vocab-size", "4096", "--max-steps", "1100"],
    "t48-b256-850-mp10": ["--max-seq-len", "48", "--batch-size", "256", "--vocab-size", "4096", "--max-steps", "850",
                          "--max-predictions", "10"],
}


def run_one(name: str, extra: list[str], args: argparse.Namespace) -> dict:
    out = Path(args.out) / name
    cmd = [sys.executable, "-m", "training.pretrain", "--out", str(out / "model"), "--run-dir", str(out / "run"),
           "--cache-dir", args.cache_dir, "--device", args.device, "--no-progress", "--fresh",
           "--data-workers", "1", "--eval-every", str(args.eval_every), "--threads", str(args.threads),
           *(["--corpus", *args.corpus] if args.corpus else []),
           *(["--precision", "fp32"] if args.device == "cuda" else []), *extra]
    if args.time_steps:
        cmd += ["--max-steps", str(args.time_steps), "--eval-every", "0", "--eval-batches", "1"]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    record = {"name": name, "args": extra, "seconds": round(time.perf_counter() - started, 1), "rc": proc.returncode}
    summary = out / "model" / "training_summary.json"
    if proc.returncode == 0 and summary.is_file():
        s = json.loads(summary.read_text())
        record.update(heldout=s["heldout"], steps=s["steps"], train_s=s["wall_time_s"],
                      s_per_step=round(s["wall_time_s"] / s["steps"], 4))
        events = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
        record["curve"] = [(e["step"], round(e["mlm_accuracy"], 3), round(e["nsp_accuracy"], 3))
                           for e in events if e["event"] == "eval"]
    else:
        record["stderr"] = proc.stderr[-2000:]
    print(json.dumps(record), flush=True)
    return record


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--corpus", nargs="*", default=[])
    p.add_argument("--cache-dir", default=".cache/bertserve")
    p.add_argument("--device", default="cpu")
    p.add_argument("--parallel", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eval-every", type=int, default=400, help="held-out evaluation every N steps (a curve)")
    p.add_argument("--only", default=None, help="comma-separated candidate names")
    p.add_argument("--time-steps", type=int, default=0, help="only time this many steps of each candidate")
    args = p.parse_args()
    names = args.only.split(",") if args.only else list(CANDIDATES)
    os.makedirs(args.out, exist_ok=True)
    # Build each vocabulary's data cache once, before the candidates race for it.
    for vocab in sorted({int(c[c.index("--vocab-size") + 1]) if "--vocab-size" in c else 8192
                         for n, c in CANDIDATES.items() if n in names}):
        prepare_data(DataConfig(corpus=tuple(args.corpus), vocab_size=vocab, cache_dir=args.cache_dir),
                     show_progress=False)
    with ThreadPoolExecutor(args.parallel) as pool:
        records = list(pool.map(lambda n: run_one(n, CANDIDATES[n], args), names))
    (Path(args.out) / "sweep.json").write_text(json.dumps(records, indent=2) + "\n")
    print("| candidate | steps | MLM acc (most frequent) | NSP acc (majority) | s/step |")
    print("| --- | --- | --- | --- | --- |")
    for r in records:
        h = r.get("heldout")
        if h:
            print(f"| {r['name']} | {r['steps']} | {h['mlm_accuracy']:.3f} ({h['mlm_baseline_accuracy']:.3f}) | "
                  f"{h['nsp_accuracy']:.3f} ({h['nsp_baseline_accuracy']:.3f}) | {r['s_per_step']} |")
        else:
            print(f"| {r['name']} | failed rc {r['rc']} | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
