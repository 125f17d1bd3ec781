"""Training plots: every run writes training.png beside metrics.jsonl, and `python -m training.report`
plots any run folder, also one whose last line is still being written; a folder that is not a run is
one line."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.image import imread

from tests.test_trainer import cache_dir, corpus, small_args  # noqa: F401 - fixtures
from training.pretrain import main

ROOT = Path(__file__).resolve().parents[1]


def _assert_a_drawn_plot(png: Path) -> None:
    image = imread(png)  # fails on a truncated or non-PNG file
    height, width = image.shape[:2]
    assert width >= 800 and height >= 400, image.shape
    pixels = image[..., :3].reshape(-1, 3)
    assert (pixels < 0.9).any(axis=1).mean() > 0.02  # lines and text drawn, not a blank canvas
    assert len(np.unique((pixels * 255).astype(np.uint8), axis=0)) > 8  # several colours: the series


@pytest.fixture(scope="module")
def run_dir(corpus, cache_dir, tmp_path_factory):  # noqa: F811
    folder = tmp_path_factory.mktemp("report")
    assert main(small_args(corpus, cache_dir, folder / "model", folder / "run", "--max-steps", "6",
                           "--log-every", "2", "--eval-every", "3", "--heldout-fraction", "0.2")) == 0
    return folder / "run"


def test_every_run_writes_its_plots(run_dir):
    _assert_a_drawn_plot(run_dir / "training.png")
    assert not list(run_dir.glob(".training.png.*"))  # written whole, through a temporary file


def test_report_plots_a_run_still_going(run_dir, tmp_path):
    going = tmp_path / "going"
    going.mkdir()
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (going / "metrics.jsonl").write_text("".join(lines[:-2]) + lines[-2][: len(lines[-2]) // 2])  # mid-write
    done = subprocess.run([sys.executable, "-m", "training.report", str(going)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(going / "training.png")
    _assert_a_drawn_plot(going / "training.png")


def test_an_out_that_cannot_be_written_is_named_in_one_line(run_dir, tmp_path):
    out = tmp_path / "missing" / "plot.png"
    done = subprocess.run([sys.executable, "-m", "training.report", str(run_dir), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr == f"cannot plot: No such file or directory writing {out}\n", done.stderr


@pytest.mark.parametrize("case,words", [("missing", "is not a folder"), ("no_metrics", "has no metrics.jsonl"),
                                        ("empty", "has no training records")])
def test_a_folder_that_is_not_a_run_is_one_line(tmp_path, case, words):
    folder = tmp_path / "run"
    if case != "missing":
        folder.mkdir()
    if case == "empty":
        (folder / "metrics.jsonl").write_text('{"event": "start", "step": 0}\n')
    done = subprocess.run([sys.executable, "-m", "training.report", str(folder)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and words in done.stderr, done.stderr
    assert not (folder / "training.png").exists()


def test_help_gives_the_whole_first_paragraph_of_the_module_docstring():
    import training.report

    done = subprocess.run([sys.executable, "-m", "training.report", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    paragraph = " ".join(training.report.__doc__.split("\n\n")[0].split())
    assert paragraph.endswith("also one still going.") and paragraph in " ".join(done.stdout.split()), done.stdout
