"""The trainer on the CPU with real parts: optimiser groups, schedule, the fixed-shape MLM gather,
checkpoints, exact resume, learning, and a 2-process DDP run under torchrun (gloo)."""
from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training.checkpoint import CheckpointError, list_checkpoints, load_checkpoint, save_checkpoint
from training.model import BertForPreTraining, preset_config
from training.model_folder import load_model_folder
from training.optim import WarmupLinearDecay, make_optimizer, param_groups
from training.pretrain import main
from training.model_inputs import gather_masked

REPO = Path(__file__).resolve().parents[1]

_TOPICS = {
    "cooking": ("the chef", "a cook", "the baker", "soup", "bread", "onions", "the oven", "salt", "stirs", "bakes"),
    "sailing": ("the sailor", "a captain", "the crew", "the boat", "the sail", "wind", "the harbour", "waves", "steers", "anchors"),
    "music": ("the pianist", "a singer", "the band", "a melody", "the chorus", "drums", "the stage", "rhythm", "plays", "sings"),
    "gardening": ("the gardener", "a farmer", "the child", "roses", "seeds", "the soil", "water", "tomatoes", "plants", "waters"),
    "computing": ("the programmer", "a compiler", "the server", "memory", "the kernel", "threads", "a socket", "bytes", "allocates", "parses"),
}


def write_corpus(path: Path, n_docs: int = 120, seed: int = 0) -> Path:
    """A .txt corpus of `n_docs` documents (blank-line separated), each about one topic, so that both
    masked words and whether B follows A are learnable from little text. A sentence drawn again is drawn
    anew (from a generator of its own: the rest stays as it was) while its topic has unused ones: the held-out
    split leaves out what training documents hold."""
    rng, again = random.Random(seed), random.Random(-seed - 1)
    docs, used = [], set()
    for _ in range(n_docs):
        topic = rng.choice(sorted(_TOPICS))
        words = _TOPICS[topic]
        sentences = []
        for _ in range(rng.randint(4, 8)):
            draw = rng
            for _ in range(50):
                subject, obj, verb = draw.choice(words[:3]), draw.choice(words[3:8]), draw.choice(words[8:])
                text = f"{subject.capitalize()} {verb} {obj} near {draw.choice(words[3:8])} in the {topic} story."
                if text not in used:
                    break
                draw = again
            used.add(text)
            sentences.append(text)
        docs.append("\n".join(sentences))
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "topics.txt")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")


def small_args(corpus: Path, cache_dir: Path, out: Path, run_dir: Path, *extra: str) -> list[str]:
    """Flags of a run that takes a few seconds on 2 cores."""
    return ["--corpus", str(corpus), "--cache-dir", str(cache_dir), "--out", str(out), "--run-dir", str(run_dir),
            "--vocab-size", "300", "--max-seq-len", "32", "--max-predictions", "5", "--batch-size", "8",
            "--heldout-fraction", "0.1", "--eval-batches", "4", "--no-progress", *extra]


def fails_in_one_line(capsys, argv: list[str], *expected: str) -> str:
    """`python -m training.pretrain argv` exits 2 with one `error:` line holding every `expected` text."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    for text in expected:
        assert text in err, err
    return err


def read_metrics(run_dir: Path, event: str = "train") -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["event"] == event]


# --- optimiser and schedule -----------------------------------------------------------------------

def test_no_weight_decay_on_biases_and_layernorm():
    model = BertForPreTraining(preset_config("tiny", vocab_size=200))
    decay, no_decay = param_groups(model, weight_decay=0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    no_decay_names = {names[id(p)] for p in no_decay["params"]}
    decay_names = {names[id(p)] for p in decay["params"]}
    assert all(n.endswith("bias") or "LayerNorm" in n for n in no_decay_names)
    assert "bert.encoder.layer.0.attention.output.LayerNorm.weight" in no_decay_names
    assert "cls.predictions.bias" in no_decay_names
    assert "bert.embeddings.word_embeddings.weight" in decay_names  # tied to the decoder: listed once
    assert not any(n.endswith("bias") or "LayerNorm" in n for n in decay_names)
    assert len(decay_names) + len(no_decay_names) == len(list(model.parameters()))


def test_warmup_then_linear_decay_to_zero():
    opt = make_optimizer(torch.nn.Linear(2, 2), lr=1.0, weight_decay=0.0, device=torch.device("cpu"))
    schedule = WarmupLinearDecay(opt, peak_lr=1.0, warmup_steps=4, total_steps=12)
    lrs = []
    for _ in range(12):
        lrs.append(opt.param_groups[0]["lr"])
        schedule.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4:] == pytest.approx([1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125])
    assert schedule.lr == 0.0
    resumed = WarmupLinearDecay(opt, peak_lr=1.0, warmup_steps=4, total_steps=12)
    resumed.load_state_dict({"step_count": 6})
    assert opt.param_groups[0]["lr"] == pytest.approx(lrs[6])


def test_gather_masked_has_a_fixed_width():
    labels = torch.full((3, 10), -100)
    labels[0, [2, 5, 7]] = torch.tensor([11, 12, 13])
    labels[2, [9]] = 14
    positions, gathered = gather_masked(labels, max_predictions=4)
    assert positions.shape == gathered.shape == (3, 4)
    assert positions[0].tolist() == [2, 5, 7, 0] and gathered[0].tolist() == [11, 12, 13, -100]
    assert gathered[1].tolist() == [-100] * 4
    assert positions[2, 0] == 9 and gathered[2, 0] == 14
    with pytest.raises(ValueError, match="more than max_predictions"):
        gather_masked(labels, max_predictions=2)


# --- checkpoints ------------------------------------------------------------------------------------

def test_checkpoints_are_atomic_and_only_the_last_k_are_kept(tmp_path):
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, {"format": 1, "step": step, "w": torch.arange(3)}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["ckpt-00000020.pt", "ckpt-00000030.pt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind
    (tmp_path / ".ckpt-00000040.pt.tmp-123").write_bytes(b"half a checkpoint")  # a crash mid-write
    assert list_checkpoints(tmp_path)[-1].name == "ckpt-00000030.pt"
    assert load_checkpoint(list_checkpoints(tmp_path)[-1])["step"] == 30

    newest = list_checkpoints(tmp_path)[-1]
    newest.write_bytes(newest.read_bytes()[:100])  # truncated by a full disk, say
    with pytest.raises(CheckpointError, match=r"ckpt-00000030\.pt is corrupt.*resume from ckpt-00000020\.pt"):
        load_checkpoint(newest)


# --- whole runs -----------------------------------------------------------------------------------

def test_resume_continues_exactly(cache_dir, tmp_path, capsys):
    """2N steps straight == N steps, a crash, --resume, N more steps: same losses, same weights.
    With dropout on, gradient accumulation, and an epoch boundary between N and 2N."""
    corpus = write_corpus(tmp_path / "short.txt", n_docs=100, seed=2)  # an epoch: between N and 2N steps
    n = 8
    flags = ["--max-steps", str(2 * n), "--checkpoint-every", str(n), "--keep-checkpoints", "5",
             "--log-every", "1", "--grad-accum", "2", "--eval-every", "0",
             "--heldout-fraction", "0.2"]  # NSP balancing halves the small held-out split: keep one batch
    assert main(small_args(corpus, cache_dir, tmp_path / "a", tmp_path / "run_a", *flags)) == 0
    straight = read_metrics(tmp_path / "run_a")
    assert [r["step"] for r in straight] == list(range(1, 2 * n + 1))
    assert straight[n - 1]["epoch"] == 0 < straight[-1]["epoch"], "N should lie in epoch 0, 2N after it"

    # A run that crashed right after step N would have left exactly run A's checkpoint of step N.
    run_b = tmp_path / "run_b"
    run_b.mkdir()
    shutil.copy2(tmp_path / "run_a" / f"ckpt-{n:08d}.pt", run_b)
    assert main(small_args(corpus, cache_dir, tmp_path / "b", run_b, *flags, "--resume")) == 0
    resumed = read_metrics(run_b)
    assert [r["step"] for r in resumed] == list(range(n + 1, 2 * n + 1))
    for a, b in zip(straight[n:], resumed):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6), f"step {a['step']}"
        assert b["lr"] == a["lr"]
    assert resumed[-1]["tokens_seen"] == straight[-1]["tokens_seen"]
    weights_a, weights_b = (load_model_folder(tmp_path / d).model.state_dict() for d in ("a", "b"))
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
    assert "resuming from" in capsys.readouterr().out


def test_tokens_seen_survives_a_resume_from_a_checkpoint_between_log_lines(cache_dir, tmp_path):
    """A checkpoint at step 5 with a log line every 10 steps (SIGTERM checkpoints at any step): the
    resumed run counts the tokens of steps 1-5, as the straight run does."""
    corpus = write_corpus(tmp_path / "short.txt", n_docs=100, seed=2)
    flags = ["--max-steps", "12", "--checkpoint-every", "5", "--keep-checkpoints", "5", "--log-every", "10",
             "--eval-every", "0", "--heldout-fraction", "0.2"]
    assert main(small_args(corpus, cache_dir, tmp_path / "a", tmp_path / "run_a", *flags)) == 0
    run_b = tmp_path / "run_b"
    run_b.mkdir()
    shutil.copy2(tmp_path / "run_a" / "ckpt-00000005.pt", run_b)
    assert main(small_args(corpus, cache_dir, tmp_path / "b", run_b, *flags, "--resume")) == 0
    straight, resumed = (json.loads((tmp_path / d / "training_summary.json").read_text())["tokens_seen"]
                         for d in ("a", "b"))
    assert resumed == straight > 0


def test_loss_really_drops(cache_dir, tmp_path):
    """100 steps on six documents repeated ten times: the loss falls far and held-out MLM accuracy
    beats always predicting the most frequent token."""
    distinct = write_corpus(tmp_path / "six.txt", n_docs=6, seed=7).read_text().strip().split("\n\n")
    corpus = tmp_path / "repeated.txt"
    corpus.write_text("\n\n".join(distinct * 10) + "\n")
    out, run_dir = tmp_path / "model", tmp_path / "run"
    assert main(small_args(corpus, cache_dir, out, run_dir, "--max-steps", "100", "--lr", "2e-3",
                           "--log-every", "10", "--heldout-fraction", "0.5", "--eval-batches", "8")) == 0
    losses = [r["loss"] for r in read_metrics(run_dir)]
    assert losses[-1] < losses[0] - 1.0 and min(losses[-3:]) < min(losses[:3]), losses
    final = json.loads((out / "training_summary.json").read_text())["heldout"]
    assert final["mlm_accuracy"] > final["mlm_baseline_accuracy"] + 0.03, final


def test_torchrun_two_cpu_processes(corpus, cache_dir, tmp_path):
    """DDP over gloo: rank 0 writes one loadable folder; the ranks read disjoint halves of each batch.

    Without dropout, the first step's NSP loss (averaged over the two ranks, each over its own half)
    must equal one process's over the whole batch: it would not if both ranks read the same half."""
    common = ["--max-steps", "3", "--log-every", "1", "--dropout", "0", "--eval-every", "0",
              "--heldout-fraction", "0.2"]  # one held-out batch of 16 after NSP balancing
    assert main(small_args(corpus, cache_dir, tmp_path / "single", tmp_path / "run1", *common,
                           "--batch-size", "16")) == 0
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "training.pretrain", *small_args(corpus, cache_dir, tmp_path / "ddp", tmp_path / "run2", *common)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "TMPDIR": str(tmp_path)}  # torchrun's agent leaves a torchelastic_* folder there
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("done:") == 1  # only rank 0 reports
    single, ddp = read_metrics(tmp_path / "run1")[0], read_metrics(tmp_path / "run2")[0]
    assert ddp["nsp_loss"] == pytest.approx(single["nsp_loss"], abs=1e-5)
    assert ddp["tokens_seen"] == single["tokens_seen"]
    loaded = load_model_folder(tmp_path / "ddp")
    assert loaded.has_mlm_head and loaded.has_nsp_head
    summary = json.loads((tmp_path / "ddp" / "training_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3
    assert [p.name for p in list_checkpoints(tmp_path / "run2")] == ["ckpt-00000003.pt"]


def test_training_leaves_garbage_collection_as_it_found_it(corpus, cache_dir, tmp_path, monkeypatch):
    """Automatic collection is off while steps run (collected on a schedule instead) and back on after,
    also when a step fails."""
    import gc

    import training.trainer as trainer
    seen = []
    real_step = trainer.optimizer_step

    def step(*args, **kwargs):
        seen.append(gc.isenabled())
        if len(seen) == 3:
            raise RuntimeError("a failing step")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(trainer, "optimizer_step", step)
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="a failing step"):
        main(small_args(corpus, cache_dir, tmp_path / "model", tmp_path / "run", "--max-steps", "5",
                        "--data-workers", "0"))
    assert seen == [False, False, False] and gc.isenabled()
