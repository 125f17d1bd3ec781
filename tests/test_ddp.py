"""The DDP options (training.ddp) on CPUs over gloo: the pretrain flags under torchrun."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from test_trainer import REPO, fails_in_one_line, read_metrics, small_args, write_corpus

from training.pretrain import main

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def test_pretrain_ddp_flags_under_torchrun_follow_one_process(tmp_path):
    """bf16 all-reduce, small buckets and a static graph (gradients as bucket views by default): the run
    finishes, the ranks split each batch as without them, and the losses stay with one process's at the
    same global batch (which differ only by how each half's MLM loss is averaged)."""
    corpus, cache = write_corpus(tmp_path / "corpus.txt"), tmp_path / "cache"
    common = ["--max-steps", "3", "--log-every", "1", "--dropout", "0", "--eval-every", "0", "--heldout-fraction", "0.2"]
    assert main(small_args(corpus, cache, tmp_path / "single", tmp_path / "run1", *common, "--batch-size", "16")) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "training.pretrain", *small_args(corpus, cache, tmp_path / "ddp", tmp_path / "run2", *common,
                                                   "--ddp-bf16-grads", "--ddp-bucket-mb", "0.05", "--ddp-static-graph")]
    done = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    single, ddp = read_metrics(tmp_path / "run1"), read_metrics(tmp_path / "run2")
    assert ddp[0]["nsp_loss"] == pytest.approx(single[0]["nsp_loss"], abs=1e-5)  # before any all-reduce
    assert [r["tokens_seen"] for r in ddp] == [r["tokens_seen"] for r in single]
    assert [r["loss"] for r in ddp] == pytest.approx([r["loss"] for r in single], abs=5e-3)
    summary = json.loads((tmp_path / "ddp" / "training_summary.json").read_text())
    assert summary["train_config"]["ddp"] == {"bf16_grads": True, "bucket_mb": 0.05, "bucket_view": True,
                                              "static_graph": True}


def test_static_graph_with_accumulation_is_refused(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.txt", n_docs=10)
    fails_in_one_line(capsys, small_args(corpus, tmp_path / "cache", tmp_path / "model", tmp_path / "run",
                                         "--ddp-static-graph", "--grad-accum", "2"), "--ddp-static-graph", "no_sync")

