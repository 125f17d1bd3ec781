"""The SM clock and board power each engine runs at: the padded fused-ORT graph and the served graph
(packed, our kernels) timed in turn at batch b x L, full-length rows, while nvidia-smi samples the card
every 50 ms. A card held at its power limit lowers its clock for whatever draws more, so a graph that
does the same work in fewer, denser kernels may run at a lower clock than the one it is compared with.

  python bench/engine_clocks.py                 # GPU machine, onnxruntime-gpu, kernels built; b = 256, L = 128
  python bench/engine_clocks.py --batch 32 --seconds 2 --rounds 5
  python bench/engine_clocks.py --work DIR     # keep the exports in DIR; a second run (other settings) reuses them
  python bench/engine_clocks.py --served-env BERTSERVE_KERNELS_AUTOTUNE=0   # also the served graph under that setting
  python bench/engine_clocks.py --variant three-products   # also one of engine_throughput's kernels_variants
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import numpy as np  # noqa: E402

from artifact.manifest import read_manifest  # noqa: E402
from artifact.session import kernels_library, require_cuda  # noqa: E402
from bench.engine_throughput import (DeviceBoundSession, build, fixed_batch, kernels_variants,  # noqa: E402
                                    stdlib_docstrings)

FIELDS = ("clocks.sm", "power.draw", "clocks_event_reasons.active")


class Sampler:
    """nvidia-smi's readings every `interval_ms`, each stamped with time.monotonic() as it arrives."""

    def __init__(self, interval_ms: int = 50):
        fields = FIELDS
        if subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv"],
                          capture_output=True).returncode != 0:
            fields = FIELDS[:2]  # an older nvidia-smi names the reasons otherwise: go without them
        self.samples: list[tuple[float, list[str]]] = []
        self._smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
                                      "-lms", str(interval_ms)], stdout=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self._smi.stdout:
            self.samples.append((time.monotonic(), [v.strip() for v in line.split(",")]))

    def between(self, start: float, end: float) -> dict:
        taken = [values for t, values in self.samples if start <= t <= end]
        numbers = [(float(v[0]), float(v[1])) for v in taken if v[0].replace(".", "").isdigit()]
        if not numbers:
            return {"samples": 0}
        return {"samples": len(numbers), "sm_mhz": statistics.median(c for c, _ in numbers),
                "power_w": statistics.median(p for _, p in numbers),
                "reasons": sorted({v[2] for v in taken if len(v) > 2})}

    def stop(self) -> None:
        self._smi.terminate()
        self._smi.wait()


def min_token_cosine(a, b) -> float:
    """The least cosine between two engines' first outputs (token vectors) after their last runs."""
    x, y = (io.copy_outputs_to_cpu()[0].astype(np.float64) for io, _ in (a, b))
    x, y = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
    cos = (x * y).sum(1) / (np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1))
    return float(cos.min())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--seconds", type=float, default=3.0, help="each engine's turn")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)
    p.add_argument("--work", type=Path, help="keep the exports here, and reuse them when a run left them")
    p.add_argument("--served-env", action="append", default=[], metavar="NAME=VALUE",
                   help="also time the served graph in a session made with this variable set (its kernels "
                        "read their settings when the session is made); repeatable, one engine each")
    p.add_argument("--variant", action="append", default=[],
                   help="also time this A/B variant of the served graph (bench/engine_throughput.py's "
                        "kernels_variants); repeatable")
    args = p.parse_args(argv)
    require_cuda()
    library = kernels_library("auto", "cuda")
    with tempfile.TemporaryDirectory(prefix="engine-clocks-") as temporary:
        work = args.work or Path(temporary)
        if (work / "packed-mha" / "manifest.json").is_file():  # an earlier run's exports, kept with --work
            artifacts = {kind: read_manifest(work / kind) for kind in ("padded", "packed-mha")}
        else:
            _, _, artifacts = build("base", "cuda", work, stdlib_docstrings(2000), ["PackedMultiHeadAttention"])
        padded = artifacts["padded"].graph("fp16")
        engines = {"ort fp16 padded": DeviceBoundSession(work / "padded" / padded.file, "cuda")}
        served = artifacts["packed-mha"].graph("fp16").custom_kernels
        if served and library:
            path = work / "packed-mha" / served.file
            engines["served: packed-mha+kernels"] = DeviceBoundSession(path, "cuda", kernels_library=library)
            for setting in args.served_env:
                name, _, value = setting.partition("=")
                with mock.patch.dict(os.environ, {name: value}):
                    engines[f"served, {setting}"] = DeviceBoundSession(path, "cuda", kernels_library=library)
            variants = kernels_variants(path) if args.variant else {}
            for variant in args.variant:
                if variant not in variants:
                    p.error(f"--variant {variant}: the served graph has {', '.join(variants) or 'no variants'}")
                engines[f"served, {variant}"] = DeviceBoundSession(variants[variant], "cuda", kernels_library=library)
        feed = fixed_batch(args.batch, args.seq, np.random.default_rng(0))
        prepared = {name: engine.prepare(feed) for name, engine in engines.items()}
        for name, engine in engines.items():  # warm-up: the operator's tuning, ORT's arena
            for _ in range(5):
                engine.run(prepared[name])
        agreement = {name: min_token_cosine(prepared[name], prepared["served: packed-mha+kernels"])
                     for name in engines if name.startswith("served, ")}
        sampler = Sampler()
        turns = []
        for round_ in range(args.rounds):
            for name, engine in engines.items():
                start = time.monotonic()
                runs = 0
                while time.monotonic() - start < args.seconds:
                    engine.run(prepared[name])
                    runs += 1
                end = time.monotonic()
                # the first half second of a turn is the clock settling from the turn before
                turns.append({"engine": name, "round": round_, "ms_per_batch": 1000 * (end - start) / runs,
                              **sampler.between(start + 0.5, end)})
        sampler.stop()
    print(f"{'engine':32} {'round':>5} {'ms/batch':>9} {'SM MHz':>7} {'W':>6}  reasons")
    for t in turns:
        print(f"{t['engine']:32} {t['round']:>5} {t['ms_per_batch']:9.3f} {t.get('sm_mhz', 0):7.0f} "
              f"{t.get('power_w', 0):6.0f}  {','.join(t.get('reasons', []))}")
    for name in engines:
        mine = [t for t in turns if t["engine"] == name and t["samples"]]
        if mine:
            print(f"{name}: median {statistics.median(t['ms_per_batch'] for t in mine):.3f} ms a batch at "
                  f"{statistics.median(t['sm_mhz'] for t in mine):.0f} MHz, "
                  f"{statistics.median(t['power_w'] for t in mine):.0f} W")
    for name, cosine in agreement.items():
        print(f"{name}: token vectors' least cosine with the served graph's {cosine:.6f}")
    if args.json:
        args.json.write_text(json.dumps({"batch": args.batch, "seq": args.seq, "turns": turns,
                                         "agreement": agreement}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
