"""`python -m training.pretrain` when things go wrong around it: the trainer killed, its folders
unwritable, the disk full, an earlier attempt's leftovers. Each ends in one line or cleans up after itself."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from data_corpora import write_txt_corpus
from test_trainer import REPO, fails_in_one_line, read_metrics, small_args, write_corpus

from training.checkpoint import list_checkpoints
from training.pretrain import main


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus") / "topics.txt", n_docs=80, seed=3)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("cache")



def _mount_tmpfs(folder: Path, options: str) -> None:
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip() or 'not root'}): "
                    f"a full or read-only disk cannot be made without it")


@pytest.fixture
def mounts():
    made: list[Path] = []
    yield made
    for folder in made:
        subprocess.run(["umount", str(folder)], capture_output=True)


def _descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find the workers")
def test_data_workers_end_with_a_killed_trainer(cache_dir, tmp_path):
    """Batches larger than a pipe's buffer (64 KiB): a worker that finds its trainer gone cannot exit while
    a batch it queued is stuck in the pipe (DataLoader's own check); the kernel must end it."""
    # sentences of random words: the topic corpus of 400 documents repeats most of its sentences, which the
    # held-out split leaves out
    corpus = write_txt_corpus(tmp_path / "corpus.txt", n_docs=400, sentences=(4, 8), words=(6, 12), seed=4)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "training.pretrain",
           *small_args(corpus, cache_dir, tmp_path / "model", run_dir, "--max-steps", "100000", "--log-every", "1",
                       "--eval-every", "0", "--checkpoint-every", "0", "--data-workers", "2",
                       "--batch-size", "64", "--max-seq-len", "64", "--max-predictions", "10",
                       "--heldout-fraction", "0.3")]
    trainer = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while not ((run_dir / "metrics.jsonl").exists() and read_metrics(run_dir)):  # training, workers busy
            assert trainer.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        workers = _descendants(trainer.pid)
        assert len(workers) >= 2, workers
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        deadline = time.monotonic() + 5
        while any(map(_running, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in workers if _running(p)], "data workers outlived the trainer"
    finally:
        trainer.kill()
        for pid in workers:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_second_training_into_a_run_or_model_folder_in_use_is_refused_until_the_first_ends(corpus, cache_dir,
                                                                                             tmp_path, capsys):
    """Two trainings into one --run-dir would interleave their checkpoints and metrics, and two to one --out
    (from two run folders) would each replace the other's model: the second is refused in one line naming
    the first, whatever its flags (before the checks that read the folder's checkpoints speak of them);
    once the first has ended (a kill -9 too), a run goes ahead."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "training.pretrain",
           *small_args(corpus, cache_dir, tmp_path / "first", run_dir, "--max-steps", "100000", "--log-every", "1",
                       "--eval-every", "0", "--checkpoint-every", "2")]
    first = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not list_checkpoints(run_dir):
            assert first.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        before = (run_dir / "metrics.jsonl").read_text()
        for flags in ([], ["--fresh"], ["--resume", "--seed", "5"]):
            fails_in_one_line(capsys, small_args(corpus, cache_dir, tmp_path / "second", run_dir, "--max-steps", "2",
                                                 *flags),
                              f"--run-dir {run_dir} is in use by another training (pid {first.pid} on")
        assert (run_dir / "metrics.jsonl").read_text().startswith(before)  # --fresh deleted nothing of the first's
        assert not (tmp_path / "second").exists()
        fails_in_one_line(capsys, small_args(corpus, cache_dir, tmp_path / "first", tmp_path / "other_run",
                                             "--max-steps", "2"),
                          f"--out {tmp_path / 'first'} is where another training (pid {first.pid} on")
        assert not (tmp_path / "other_run").exists()
        os.kill(first.pid, signal.SIGKILL)
        first.wait()
    finally:
        first.kill()
    assert main(small_args(corpus, cache_dir, tmp_path / "second", run_dir, "--max-steps", "2", "--fresh")) == 0
    assert main(small_args(corpus, cache_dir, tmp_path / "first", tmp_path / "other_run", "--max-steps", "2")) == 0
    assert not (run_dir / ".lock").exists() and (tmp_path / "first" / "config.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no lock left beside --out


@pytest.mark.parametrize("flag", ["--out", "--run-dir", "--cache-dir"])
@pytest.mark.parametrize("how", ["read_only", "file_in_the_way"])
def test_an_unwritable_folder_fails_before_training(corpus, cache_dir, tmp_path, capsys, mounts, flag, how):
    if how == "read_only":
        folder = tmp_path / "read_only"
        if os.geteuid() == 0:  # root writes through permission bits: only a read-only mount stops it
            _mount_tmpfs(folder, "ro,size=64k")
            mounts.append(folder)
        else:
            folder.mkdir(mode=0o555)
    else:
        folder = tmp_path / "a_file"
        folder.write_text("not a folder")
    paths = {"--out": tmp_path / "model", "--run-dir": tmp_path / "run", "--cache-dir": cache_dir,
             flag: folder / "inside"}
    started = time.perf_counter()
    fails_in_one_line(capsys, small_args(corpus, paths["--cache-dir"], paths["--out"], paths["--run-dir"],
                                         "--max-steps", "2"),
           f"{flag} {folder / 'inside'}", "cannot write")
    assert time.perf_counter() - started < 5  # before data preparation and training
    assert not (tmp_path / "run").exists() and not (tmp_path / "model").exists()


def test_a_full_disk_while_checkpointing_is_one_line_and_leaves_no_partial_file(corpus, cache_dir, tmp_path,
                                                                                 capsys, mounts):
    run_dir = tmp_path / "small_disk"
    _mount_tmpfs(run_dir, "size=256k")  # metrics.jsonl fits, a checkpoint does not
    mounts.append(run_dir)
    ckpt = run_dir / "ckpt-00000002.pt"
    fails_in_one_line(capsys, small_args(corpus, cache_dir, tmp_path / "model", run_dir, "--max-steps", "4",
                              "--checkpoint-every", "2"), f"no space left on device writing {ckpt}")
    assert sorted(p.name for p in run_dir.iterdir()) == ["metrics.jsonl"]
    assert not (tmp_path / "model").exists()


def test_ctrl_c_while_a_checkpoint_is_written_is_an_interrupt_not_a_failed_write(corpus, cache_dir, tmp_path, capsys,
                                                                                  monkeypatch):
    """Ctrl-C that lands inside torch.save makes its writer fail ("[enforce fail at inline_container.cc]
    unexpected pos"), which was told as a checkpoint that could not be written (exit 2). It is the interrupt
    it is: the one line of an interrupted run, exit 130, and no partial file."""
    import builtins

    import training.checkpoint

    class Interrupted:  # the checkpoint's file, a real one, where a SIGINT arrives during the third write
        def __init__(self, *args):
            self.file, self.writes = builtins.open(*args), 0

        def write(self, data):
            self.writes += 1
            if self.writes == 3:
                os.kill(os.getpid(), signal.SIGINT)  # the run's own handler raises KeyboardInterrupt here
            return self.file.write(data)

        def __getattr__(self, name):
            return getattr(self.file, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

    monkeypatch.setattr(training.checkpoint, "open", Interrupted, raising=False)
    run_dir = tmp_path / "run"
    code = main(small_args(corpus, cache_dir, tmp_path / "model", run_dir, "--max-steps", "4", "--checkpoint-every", "2"))
    err = capsys.readouterr().err
    assert code == 130 and "interrupted before the first checkpoint" in err and "writing" not in err, err
    assert not list(run_dir.glob("*ckpt-*")), list(run_dir.iterdir())


def test_a_full_disk_while_writing_the_model_is_one_line_and_leaves_no_partial_folder(corpus, cache_dir, tmp_path,
                                                                                      capsys, mounts):
    disk = tmp_path / "small_disk"
    _mount_tmpfs(disk, "size=256k")
    mounts.append(disk)
    fails_in_one_line(capsys, small_args(corpus, cache_dir, disk / "model", tmp_path / "run", "--max-steps", "2"),
           f"no space left on device writing {disk / 'model'}")
    assert list(disk.iterdir()) == []
    assert list_checkpoints(tmp_path / "run")  # the run itself is kept: --resume after making room


def test_temporaries_of_interrupted_checkpoint_writes_are_removed_unless_their_writer_lives(corpus, cache_dir,
                                                                                           tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait()
    alive = subprocess.Popen(["sleep", "60"])
    try:
        (run_dir / f".ckpt-00000400.pt.tmp-{gone.pid}").write_bytes(b"half a checkpoint")
        (run_dir / f".ckpt-00000400.pt.tmp-{alive.pid}").write_bytes(b"being written")
        assert main(small_args(corpus, cache_dir, tmp_path / "model", run_dir, "--max-steps", "2")) == 0
        assert sorted(p.name for p in run_dir.iterdir() if p.name.startswith(".")) == \
            [f".ckpt-00000400.pt.tmp-{alive.pid}"]
    finally:
        alive.kill()
        alive.wait()


def test_a_restart_does_not_repeat_metrics(corpus, cache_dir, tmp_path):
    """Killed before its first checkpoint, a run restarts with fresh metrics; resumed from a checkpoint,
    it drops the records of steps after it, which it trains again."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    earlier = [{"event": "start", "step": 0}, *({"event": "train", "step": s} for s in (1, 2, 3))]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in earlier) + '{"event": "tr')
    args = small_args(corpus, cache_dir, tmp_path / "model", run_dir, "--max-steps", "4", "--log-every", "1",
                      "--checkpoint-every", "2", "--eval-every", "0")
    assert main([*args, "--resume"]) == 0  # no checkpoint yet: starts over
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]
    assert len(read_metrics(run_dir, "start")) == 1

    list_checkpoints(run_dir)[-1].unlink()  # as if killed after step 4's log line, before its checkpoint
    assert main([*args, "--resume"]) == 0  # from step 2
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]
    assert [r["step"] for r in read_metrics(run_dir, "start")] == [0, 2]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped one, on purpose
def test_ctrl_c_interrupts_at_once_and_one_python_drops_still_stops_the_run():
    """Ctrl-C raises KeyboardInterrupt at once. Python drops one raised inside a __del__ (a data loader's
    clean-up of its workers at a phase's start runs there), and training used to go on: it must still ask
    the run to stop, at its step's end (trainer: stop_requested)."""
    from training.stop_signals import sigterm_stops_between_steps, stop_requested

    with pytest.raises(KeyboardInterrupt), sigterm_stops_between_steps():
        signal.raise_signal(signal.SIGINT)
        time.sleep(5)  # not reached

    class CleansUpWhenDeleted:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)
            for _ in range(10_000):  # the handler runs here, inside __del__, and its exception is dropped
                pass

    with sigterm_stops_between_steps():
        assert not stop_requested()
        loader = CleansUpWhenDeleted()
        del loader
        assert stop_requested()
    assert not stop_requested() and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_signals_the_parent_ignores_stay_ignored():
    """A shell starts a script's background job with SIGINT ignored (Ctrl-C is for the foreground): the
    training's and export's handlers leave such a signal as it was, so the job runs on."""
    from training.stop_signals import sigterm_as_interrupt, sigterm_stops_between_steps, stop_requested

    before = {signum: signal.signal(signum, signal.SIG_IGN) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        for stops in (sigterm_stops_between_steps, sigterm_as_interrupt):
            with stops():
                for signum in before:
                    assert signal.getsignal(signum) is signal.SIG_IGN
                    signal.raise_signal(signum)  # nothing happens
                assert not stop_requested()
            assert all(signal.getsignal(signum) is signal.SIG_IGN for signum in before)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_an_interrupt_caught_after_it_ended_a_string_exec_still_exits_with_the_programs_code(tmp_path):
    """An interrupt that lands in code made by a string exec (every dataclass method, many made while torch
    imports) is marked unhandled by CPython even when caught: under `python -m`, as export, pretrain and
    the server run, the process then died of SIGINT instead of exiting 130. forget_caught_interrupt, which
    those entry points call where they catch it, clears the mark."""
    (tmp_path / "interrupted_in_exec.py").write_text(
        "import sys\n"
        "from training.stop_signals import forget_caught_interrupt\n"
        "try:\n"
        "    exec('raise KeyboardInterrupt', {})\n"
        "except KeyboardInterrupt:\n"
        "    forget_caught_interrupt()\n"
        "    sys.exit(130)\n")
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}"}
    done = subprocess.run([sys.executable, "-m", "interrupted_in_exec"], env=env, capture_output=True, timeout=60)
    assert done.returncode == 130, done.stderr


@pytest.mark.parametrize("code", [0, 2])
def test_a_stop_while_a_finished_command_exits_keeps_its_exit_code(code):
    """pretrain and export end with exit_with: once a run has succeeded, a SIGTERM while the interpreter
    ends (about a second with torch loaded; here from an atexit callback) no longer turns exit 0 into
    143. A failed run still dies of it."""
    program = ("import atexit, os, signal, time\n"
               "from training.stop_signals import exit_with\n"
               "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(0.5)))\n"
               f"exit_with({code})\n")
    done = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == (0 if code == 0 else -signal.SIGTERM), (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr


def test_an_interrupt_while_the_temporary_folder_is_made_leaves_none(tmp_path):
    """remove_unfinished with no folder yet (the interrupt came as temporary_sibling made it) removes this
    process's own unfinished sibling of the destination, and nothing else: another live writer's, or an
    earlier artifact moved aside."""
    from training.writes import remove_unfinished, temporary_sibling

    dest = tmp_path / "art"
    mine = temporary_sibling(dest, ".partial")
    others = [tmp_path / f".art.{os.getppid()}.x.partial", tmp_path / f".art.{os.getpid()}.y.old"]
    for path in others:
        path.mkdir()
    remove_unfinished(dest, None, ".partial")
    assert not mine.exists() and all(path.exists() for path in others)
    made = temporary_sibling(dest, ".partial")
    remove_unfinished(dest, made, ".partial")
    assert not made.exists() and all(path.exists() for path in others)
