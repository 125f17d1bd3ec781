"""Plots of a training run from its `metrics.jsonl`: loss, held-out MLM and NSP accuracy against their
baselines, tokens/s, learning rate and gradient norm, against steps. The trainer writes them next to
the metrics at every evaluation and at the end; this makes them for any run, also one still going.

  python -m training.report RUN_DIR [--out FILE]      # default RUN_DIR/training.png
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from training.writes import WriteError, write_failed

log = logging.getLogger(__name__)

PLOT_FILE = "training.png"


class ReportError(ValueError):
    """A run folder that cannot be plotted; the message says why."""


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """The train and eval records of a metrics.jsonl, in order. A line being written (the last, without
    its newline) or one that is not JSON is passed over."""
    train, evals = [], []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True):
        if not line.endswith("\n"):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("event") == "train":
            train.append(record)
        elif record.get("event") == "eval":
            evals.append(record)
    return train, evals


def write_plots(run_dir: Path | str, out: Path | str | None = None) -> Path:
    """Renders the run's plots into `out` (default RUN_DIR/training.png), replaced whole: a reader never
    sees half a file."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not run_dir.is_dir():
        raise ReportError(f"{run_dir} is not a folder; give the run folder of `python -m training.pretrain`")
    if not metrics.is_file():
        raise ReportError(f"{run_dir} has no metrics.jsonl: it is not a training run folder (or no step was logged)")
    train, evals = read_metrics(metrics)
    if not train and not evals:
        raise ReportError(f"{metrics} has no training records yet")
    out = Path(out) if out is not None else run_dir / PLOT_FILE
    figure = _figure(train, evals, run_dir.name)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        figure.savefig(tmp, format="png", dpi=90)
        os.replace(tmp, out)
    except OSError as e:  # said of the file asked for, not of the temporary one beside it
        raise write_failed(out, e) from e
    finally:
        tmp.unlink(missing_ok=True)
    return out


def write_plots_quietly(run_dir: Path) -> None:
    """write_plots for the trainer: a plot that cannot be made is one log line, never a failed run."""
    try:
        write_plots(run_dir)
    except Exception as e:  # noqa: BLE001 - plots are a view of the run, not part of it
        log.warning("could not plot %s: %s", run_dir, e)


def _figure(train: list[dict], evals: list[dict], title: str):
    # A bare Figure, not pyplot: no global figure registry to close, no display; savefig renders with Agg.
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 8), layout="constrained")
    axes = fig.subplots(2, 3)
    fig.suptitle(f"{title}: {train[-1]['step'] if train else evals[-1]['step']} steps")
    steps = [r["step"] for r in train]

    def series(records, key):
        return [r["step"] for r in records if key in r], [r[key] for r in records if key in r]

    ax = axes[0, 0]
    for key, label in (("loss", "total"), ("mlm_loss", "MLM"), ("nsp_loss", "NSP")):
        ax.plot(*series(train, key), label=f"train {label}")
    for key, label in (("mlm_loss", "MLM"), ("nsp_loss", "NSP")):
        ax.plot(*series(evals, key), "o--", label=f"held-out {label}")
    ax.set(title="loss", xlabel="step")
    ax.legend(fontsize=8)

    for ax, (name, baseline_name) in zip((axes[0, 1], axes[0, 2]), (("mlm", "most frequent token"),
                                                                    ("nsp", "majority class"))):
        ax.plot(*series(evals, f"{name}_accuracy"), "o-", label="held-out")
        ax.plot(*series(evals, f"{name}_baseline_accuracy"), ":", color="grey", label=baseline_name)
        ax.set(title=f"{name.upper()} accuracy", xlabel="step", ylim=(0, 1) if name == "nsp" else None)
        ax.legend(fontsize=8)

    for ax, key, title in ((axes[1, 0], "tokens_per_s", "tokens/s"), (axes[1, 1], "lr", "learning rate"),
                           (axes[1, 2], "grad_norm", "gradient norm (before clipping)")):
        ax.plot(steps, [r.get(key, float("nan")) for r in train])
        ax.set(title=title, xlabel="step")
    # Where a later phase (e.g. the longer sequences of phase 2) starts.
    changes = [b["step"] for a, b in zip(train, train[1:]) if a.get("phase") != b.get("phase")]
    for ax in axes.flat:
        for step in changes:
            ax.axvline(step, color="grey", linewidth=0.8, linestyle="--")
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m training.report",
                                     description=__doc__.split("\n\n")[0])  # the first paragraph
    parser.add_argument("run_dir", type=Path, help="a run folder (it holds metrics.jsonl)")
    parser.add_argument("--out", type=Path, help=f"the PNG to write (default RUN_DIR/{PLOT_FILE})")
    args = parser.parse_args(argv)
    try:
        print(write_plots(args.run_dir, args.out))
    except (ReportError, WriteError, OSError) as e:
        print(f"cannot plot: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
