"""The DDP options (training.ddp) on CPUs over gloo: the pretrain flags under torchrun, bf16 gradient
all-reduce against fp32, and bench/ddp_scaling.py end to end."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from test_trainer import REPO, fails_in_one_line, read_metrics, small_args, write_corpus

from training.pretrain import main

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


def _env(tmp_path) -> dict[str, str]:
    return {**ENV, "TMPDIR": str(tmp_path)}  # torchrun's agent leaves a torchelastic_* folder in TMPDIR


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
    done = subprocess.run(cmd, cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "is deprecated" not in done.stderr, done.stderr[-3000:]  # a warning from each rank
    single, ddp = read_metrics(tmp_path / "run1"), read_metrics(tmp_path / "run2")
    assert ddp[0]["nsp_loss"] == pytest.approx(single[0]["nsp_loss"], abs=1e-5)  # before any all-reduce
    assert [r["tokens_seen"] for r in ddp] == [r["tokens_seen"] for r in single]
    assert [r["loss"] for r in ddp] == pytest.approx([r["loss"] for r in single], abs=5e-3)
    summary = json.loads((tmp_path / "ddp" / "training_summary.json").read_text())
    assert summary["train_config"]["ddp"] == {"bf16_grads": True, "bucket_mb": 0.05, "bucket_view": True,
                                              "static_graph": True, "graph_per_bucket": False,
                                              "broadcast_buffers": False}


def test_static_graph_with_accumulation_is_refused(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.txt", n_docs=10)
    fails_in_one_line(capsys, small_args(corpus, tmp_path / "cache", tmp_path / "model", tmp_path / "run",
                                         "--ddp-static-graph", "--grad-accum", "2"), "--ddp-static-graph", "no_sync")


def test_ddp_scaling_bench_on_cpu(tmp_path):
    """One process, then two, through the trainer's step: every variant runs; the options that only move
    memory or change bucketing, and the training loop's per-step agreement on stopping, give the same losses as
    plain DDP to the last bit, bf16 all-reduce nearly
    the same, and skipping the all-reduce (nocomm) other ones. Accumulating, a static graph is refused.
    A profiled step reports its busiest operators."""
    out = tmp_path / "ddp_scaling.json"
    cmd = [sys.executable, "bench/ddp_scaling.py", "--device", "cpu", "--preset", "tiny", "--vocab-size", "500",
           "--seq-len", "32", "--max-predictions", "5", "--batch-sizes", "8", "--steps", "2", "--warmup", "2",
           "--variants", "plain,asview+bucket1,plain+stop,bf16,nocomm,static", "--grad-accum", "2",
           "--profile-steps", "1",
           "--trace-dir", str(tmp_path / "traces"), "--json", str(out)]
    done = subprocess.run(cmd, cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    runs = {(r["nproc"], r["variant"]): r for r in report["runs"]}
    assert set(runs) == {(1, "single"), *((2, v) for v in ("plain", "asview+bucket1", "plain+stop", "bf16", "nocomm",
                                                                       "static"))}
    assert "--grad-accum" in runs[2, "static"]["error"]
    measured = {v: r for (n, v), r in runs.items() if n == 2 and v != "static"}
    for r in measured.values():
        assert r["tokens_per_s_total"] > 0 and len(r["tokens_per_s_per_process"]) == 2 and r["scaling"] > 0, r
    plain = measured["plain"]["loss"]
    assert measured["asview+bucket1"]["loss"] == plain and measured["plain+stop"]["loss"] == plain
    assert measured["bf16"]["loss"] == pytest.approx(plain, rel=1e-3) and measured["bf16"]["loss"] != plain
    assert measured["nocomm"]["loss"] != plain
    ranks = measured["plain"]["profile"]  # each rank's view; CPU only: no GPU time, the busiest operators
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["steps"] == 1 and r["wall_ms_per_step"] > 0 and r["gpu_busy_ms_per_step"] == 0, r
        assert any("mm" in name for name in r["top_self_cpu_ms_per_step"]), r
    assert sorted(p.name for p in (tmp_path / "traces" / "plain-b8").iterdir()) == ["rank0.json.gz", "rank1.json.gz"]
    # the whole gradient in one piece (fp32, bf16), then fp32 in DDP's 25 MB pieces: one here, a tiny model
    assert [(r["dtype"], r["pieces"]) for r in report["allreduce"]] == [("float32", 1), ("bfloat16", 1), ("float32", 1)]
    assert all(r["ms"] > 0 and r["mb"] > 0 for r in report["allreduce"])
    assert "| 8 | 2 | bf16 |" in done.stdout


@pytest.mark.slow  # compiles on the CPU: about 35 s
def test_the_compiled_ddp_model_is_one_graph_that_computes_what_the_model_does(tmp_path):
    """The trainer's default under --compile: dynamo's DDP graph splitting off, and the compiled DDP model
    gives the eager model's loss and gradients (one process over gloo: DDP's averaging is then the identity)."""
    import dataclasses

    import torch
    import torch.distributed as torch_dist

    from bench.train_throughput import make_batch
    from training.ddp import DDPOptions, compile_ddp, wrap_ddp
    from training.model import BertForPreTraining, preset_config
    from training.model_inputs import cpu_inputs, inputs_to_device

    config = dataclasses.replace(preset_config("tiny", vocab_size=500), hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    eager = BertForPreTraining(config)
    inputs = inputs_to_device(cpu_inputs(make_batch(4, 32, 500, 5), 5, pad_to=32), torch.device("cpu"))
    eager(**inputs).loss.backward()
    torch_dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = BertForPreTraining(config)
        compiled = compile_ddp(wrap_ddp(model, torch.device("cpu"), DDPOptions()), DDPOptions())
        loss = compiled(**inputs).loss
        loss.backward()
        assert torch._dynamo.config.optimize_ddp is False
    finally:
        torch_dist.destroy_process_group()
        torch._dynamo.reset()
        torch._dynamo.config.optimize_ddp = True  # torch's default, for whatever runs next in this process
    assert loss.item() == pytest.approx(eager(**inputs).loss.item(), abs=1e-5)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-5), name


SLOW_PREPARATION = """
import datetime, sys, time
import torch.distributed.distributed_c10d as c10d
import training.data, training.trainer
from training.pretrain import main

c10d.default_pg_timeout = datetime.timedelta(seconds=5)  # the training group's (NCCL's is 10 minutes)
build = training.data._build
def slow_build(*args, **kwargs):
    time.sleep(10)
    return build(*args, **kwargs)
training.data._build = slow_build
training.trainer.write_plots_quietly = lambda run_dir: None  # rank 0 alone, while rank 1 waits 5 s at most
sys.exit(main(sys.argv[1:]))
"""


def test_the_ranks_wait_for_rank_0s_data_preparation_past_the_process_groups_timeout(tmp_path):
    """Rank 0 tokenises the corpus while the others wait, however long that takes: a preparation longer
    than the process group's timeout (NCCL's 10 minutes; here gloo's, cut to 5 s) is no failure."""
    script = tmp_path / "slow_preparation.py"
    script.write_text(SLOW_PREPARATION)
    corpus = write_corpus(tmp_path / "corpus.txt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           *small_args(corpus, tmp_path / "cache", tmp_path / "model", tmp_path / "run", "--max-steps", "2",
                       "--heldout-fraction", "0.2")]
    done = subprocess.run(cmd, cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("done:") == 1


AS_ON_ANOTHER_MACHINE = """
import os, sys
import training.data, training.pretrain
from training.pretrain import main

training.data._WAIT_LOG_S = training.pretrain.LOCAL_RANK_0_SAYS_S = 1.0
args = sys.argv[1:]
if os.environ["RANK"] == "1":  # as on another machine: FLAG-rank1 for the folder FLAG names (env OWN)
    args[args.index(os.environ["OWN"]) + 1] += "-rank1"
sys.exit(main(args))
"""


def test_a_rank_waiting_for_a_cache_rank_0_prepared_elsewhere_says_so_and_goes_on_once_it_is_copied(tmp_path):
    script, err = tmp_path / "as_on_another_machine.py", tmp_path / "stderr.txt"
    script.write_text(AS_ON_ANOTHER_MACHINE)
    corpus, cache = write_corpus(tmp_path / "corpus.txt"), tmp_path / "cache"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           *small_args(corpus, cache, tmp_path / "model", tmp_path / "run", "--max-steps", "2",
                       "--heldout-fraction", "0.2")]
    with err.open("w") as stderr:
        run = subprocess.Popen(cmd, cwd=REPO, env={**_env(tmp_path), "OWN": "--cache-dir"}, stdout=subprocess.PIPE,
                               stderr=stderr, text=True)
        try:
            deadline = time.monotonic() + 120
            while "which rank 0 prepares" not in err.read_text():
                assert run.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
                time.sleep(0.5)
            [prepared] = cache.glob("data-*")
            copy = tmp_path / "cache-rank1" / "copying"
            shutil.copytree(prepared, copy)
            copy.rename(copy.with_name(prepared.name))
            out, _ = run.communicate(timeout=120)
        finally:
            run.terminate()  # torchrun ends its workers on SIGTERM (each in a session of its own: a kill would not)
            run.wait(timeout=60)
    assert run.returncode == 0, err.read_text()[-3000:]
    assert out.count("done:") == 1


def test_resuming_with_another_number_of_processes_is_refused_before_the_data_is_prepared(tmp_path):
    corpus, cache = write_corpus(tmp_path / "corpus.txt"), tmp_path / "cache"
    assert main(small_args(corpus, cache, tmp_path / "model", tmp_path / "run", "--max-steps", "2",
                           "--heldout-fraction", "0.2")) == 0
    new_cache = tmp_path / "new-cache"  # the data prepared again (another machine): refused before that
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "training.pretrain", *small_args(corpus, new_cache, tmp_path / "model", tmp_path / "run", "--max-steps",
                                            "4", "--heldout-fraction", "0.2", "--resume")]
    done = subprocess.run(cmd, cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=240)
    assert done.returncode != 0
    assert "ckpt-00000002.pt was written with world size 1; resume with the same number of processes (now 2)" \
        in done.stderr, done.stderr[-3000:]
    assert not list(new_cache.glob("data-*")) and "training tiny" not in done.stdout


def test_resuming_from_copies_of_the_run_folder_that_differ_is_refused(tmp_path):
    """On machines that share no storage each rank resumes from its own --run-dir: one left with an older
    copy is refused on every rank (it trained from other weights, then hung at the end)."""
    corpus, cache, run_dir = write_corpus(tmp_path / "corpus.txt"), tmp_path / "cache", tmp_path / "run"
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    common = ["--heldout-fraction", "0.2", "--checkpoint-every", "2"]
    done = subprocess.run([*torchrun, "-m", "training.pretrain", *small_args(corpus, cache, tmp_path / "model", run_dir,
                                                                             "--max-steps", "4", *common)],
                          cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    stale = shutil.copytree(run_dir, tmp_path / "run-rank1")
    (stale / "ckpt-00000004.pt").unlink()
    script = tmp_path / "as_on_another_machine.py"
    script.write_text(AS_ON_ANOTHER_MACHINE)
    done = subprocess.run([*torchrun, str(script), *small_args(corpus, cache, tmp_path / "model", run_dir,
                                                               "--max-steps", "6", "--resume", *common)],
                          cwd=REPO, env={**_env(tmp_path), "OWN": "--run-dir"}, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode != 0
    assert ("the ranks' --run-dir hold other newest checkpoints (ckpt-00000004.pt on rank 0; ckpt-00000002.pt on "
            "rank 1): copy rank 0's run folder") in done.stderr, done.stderr[-3000:]


@pytest.mark.parametrize("corpus_name, flag, said", [
    ("missing.txt", None, "missing.txt does not exist"),
    ("corpus.txt", "--no-such-flag", "error: unrecognized arguments: --no-such-flag"),
])
def test_a_refusal_under_torchrun_is_said_once(tmp_path, corpus_name, flag, said):
    write_corpus(tmp_path / "corpus.txt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "training.pretrain", *small_args(tmp_path / corpus_name, tmp_path / "cache", tmp_path / "model",
                                            tmp_path / "run", *([flag] if flag else []))]
    done = subprocess.run(cmd, cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=240)
    assert done.returncode != 0
    assert done.stderr.count(said) == 1 and done.stderr.count("usage:") <= 1, done.stderr[-3000:]


def test_a_refusal_of_one_rank_alone_is_said_by_it(tmp_path):
    script = tmp_path / "as_on_another_machine.py"
    script.write_text(AS_ON_ANOTHER_MACHINE)
    corpus = write_corpus(tmp_path / "corpus.txt")  # rank 1 is given corpus.txt-rank1, missing
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           *small_args(corpus, tmp_path / "cache", tmp_path / "model", tmp_path / "run")]
    done = subprocess.run(cmd, cwd=REPO, env={**_env(tmp_path), "OWN": "--corpus"}, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode != 0
    assert f"error (rank 1): corpus path {corpus}-rank1 does not exist" in done.stderr, done.stderr[-3000:]


def test_an_interrupt_under_torchrun_is_said_once(tmp_path):
    corpus, run_dir = write_corpus(tmp_path / "corpus.txt"), tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m",
           "training.pretrain", *small_args(corpus, tmp_path / "cache", tmp_path / "model", run_dir,
                                            "--max-steps", "100000", "--checkpoint-every", "5",
                                            "--heldout-fraction", "0.2")]
    run = subprocess.Popen(cmd, cwd=REPO, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(run_dir.glob("ckpt-*.pt")):
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()[1][-3000:]
            time.sleep(0.2)
        run.send_signal(signal.SIGINT)  # Ctrl-C: torchrun passes it on to each process
        _, err = run.communicate(timeout=120)
    finally:
        run.terminate()
        run.wait(timeout=60)
    assert err.count("interrupted; continue with --resume") == 1, err[-3000:]


FAILS_ONCE = """
import os, sys
import training.trainer
from training.pretrain import main

step, calls = training.trainer.optimizer_step, []
def failing_step(*args, **kwargs):
    calls.append(1)
    if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and len(calls) == 3:
        raise RuntimeError("rank 1 fails in step 3")
    return step(*args, **kwargs)
training.trainer.optimizer_step = failing_step
sys.exit(main(sys.argv[1:]))
"""


def test_torchrun_restarts_a_failed_run_from_its_last_checkpoint(tmp_path):
    """--resume from the first start, and torchrun's --max-restarts goes on from the checkpoint before the
    failure, to the weights of a run that never failed."""
    script = tmp_path / "fails_once.py"
    script.write_text(FAILS_ONCE)
    corpus, cache = write_corpus(tmp_path / "corpus.txt"), tmp_path / "cache"
    common = ["--max-steps", "4", "--checkpoint-every", "2", "--heldout-fraction", "0.2", "--resume"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = {}
    for name, how in (("restarted", ["--max-restarts", "1", str(script)]), ("whole", ["-m", "training.pretrain"])):
        done[name] = subprocess.run([*torchrun, *how, *small_args(corpus, cache, tmp_path / name,
                                                                  tmp_path / f"run-{name}", *common)],
                                    cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=240)
        assert done[name].returncode == 0, done[name].stderr[-3000:]
    assert "rank 1 fails in step 3" in done["restarted"].stderr
    assert f"resuming from {tmp_path / 'run-restarted' / 'ckpt-00000002.pt'}" in done["restarted"].stdout
    weights = [(tmp_path / name / "model.safetensors").read_bytes() for name in done]
    assert weights[0] == weights[1]


TERMINATED_ONE_RANK = """
import os, signal, sys
import training.trainer
from training.pretrain import main

step, calls = training.trainer.optimizer_step, []
def step_then_sigterm(*args, **kwargs):
    calls.append(1)
    out = step(*args, **kwargs)
    if os.environ["RANK"] == "1" and len(calls) == 3:
        os.kill(os.getpid(), signal.SIGTERM)  # one rank alone, as a signal that lands between two ranks' checks
    return out
training.trainer.optimizer_step = step_then_sigterm
sys.exit(main(sys.argv[1:]))
"""


def test_a_sigterm_that_reaches_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    """Under torchrun SIGTERM used to end each process where it was, losing the work since the last periodic
    checkpoint: a stop flag each rank read alone would decide different collective calls (the checkpoint's)
    when the signal reached the ranks at different steps. The ranks now agree on it every step, so a SIGTERM
    that reaches one rank alone stops both at the same step's end, with a checkpoint there."""
    script = tmp_path / "terminated.py"
    script.write_text(TERMINATED_ONE_RANK)
    corpus, run_dir = write_corpus(tmp_path / "corpus.txt"), tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script),
           *small_args(corpus, tmp_path / "cache", tmp_path / "model", run_dir, "--max-steps", "50",
                       "--checkpoint-every", "100", "--log-every", "100", "--heldout-fraction", "0.2")]
    done = subprocess.run(cmd, cwd=REPO, env=_env(tmp_path), capture_output=True, text=True, timeout=240)
    assert done.returncode != 0, done.stdout[-2000:]  # stopped short, not finished
    assert [p.name for p in run_dir.glob("ckpt-*.pt")] == ["ckpt-00000003.pt"], done.stderr[-3000:]
    assert done.stderr.count("interrupted; continue with --resume") == 1, done.stderr[-3000:]
