"""engine_cores: CPU cores kept for each engine process of a multi-process GPU server, the HTTP workers on
the others (app/multiprocess/cpu_cores.py)."""
from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from app.multiprocess.cpu_cores import describe, pin, split_cores
from tests.test_server import ROOT, start_server


def test_the_engines_take_the_last_cores_and_the_workers_the_rest():
    engines, workers = split_cores(set(range(16)), engines=1, per_engine=3)
    assert engines == [frozenset({13, 14, 15})] and workers == frozenset(range(13))
    # a container's cpuset, with gaps: two engines of two cores each
    engines, workers = split_cores({0, 1, 2, 3, 5, 6, 7, 9}, engines=2, per_engine=2)
    assert engines == [frozenset({5, 6}), frozenset({7, 9})] and workers == frozenset({0, 1, 2, 3})
    assert describe(frozenset({0, 1, 2, 5, 7, 8})) == "0-2,5,7-8"


def test_cores_that_leave_the_workers_none_are_refused_in_words():
    with pytest.raises(ValueError, match=r"keeps 4 cores, but this process may use only 4 \(0-3\)"):
        split_cores({0, 1, 2, 3}, engines=2, per_engine=2)


def _report_thread_cores(cores: frozenset[int], out) -> None:
    pin(cores, "a test process")
    seen = {}
    thread = threading.Thread(target=lambda: seen.update(thread=os.sched_getaffinity(0)))
    thread.start()
    thread.join()
    out.put((os.sched_getaffinity(0), seen["thread"]))


def test_a_pinned_process_and_every_thread_it_makes_run_on_its_cores():
    """As an engine process pins itself first thing: the threads it makes later (the loop's, ONNX
    Runtime's, the replaying one) inherit its cores; the process that started it keeps its own."""
    mine = os.sched_getaffinity(0)
    core = frozenset({max(mine)})
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    child = context.Process(target=_report_thread_cores, args=(core, out))
    child.start()
    process_cores, thread_cores = out.get(timeout=60)
    child.join(30)
    assert process_cores == core and thread_cores == core
    assert os.sched_getaffinity(0) == mine


@pytest.mark.parametrize("settings", [{"workers": 1, "engine_cores": 1},
                                      {"workers": 2, "engine_cores": 1, "device": "cpu"}])
def test_engine_cores_without_workers_or_with_a_cpu_engine_is_refused_in_one_line(tiny_artifact_dir, settings):
    env = {**os.environ, **{f"BERTSERVE_{k.upper()}": str(v) for k, v in settings.items()}}
    r = subprocess.run([sys.executable, "-m", "app", "--model-dir", str(tiny_artifact_dir)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "engine_cores needs workers > 1 and device cuda" in r.stderr, r.stderr


def _cores_of(pid: int) -> str:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(line.split(":", 1)[1].strip() for line in status.splitlines() if line.startswith("Cpus_allowed_list"))


def _serve_and_read_cores(artifact: Path, **settings) -> tuple[dict, str]:
    """A real multi-process server: its engine's and one worker's allowed cores, and its log."""
    proc, base = start_server(artifact, workers=2, **settings)
    try:
        info = httpx.get(f"{base}/info", timeout=30).json()
        embedded = httpx.post(f"{base}/embed", json={"inputs": ["a text"]}, timeout=30)
        cores = {"engine": _cores_of(info["engine_pid"]), "worker": _cores_of(info["pid"]),
                 "status": embedded.status_code}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    return cores, proc.stdout.read()


def test_a_server_whose_engine_runs_on_the_cpu_keeps_no_cores_and_says_so(tiny_artifact_dir):
    """device auto on a machine without CUDA: the engine needs every core, so nothing is pinned."""
    everything = describe(frozenset(os.sched_getaffinity(0)))
    cores, log = _serve_and_read_cores(tiny_artifact_dir, engine_cores=1)
    assert cores == {"engine": everything, "worker": everything, "status": 200}, log
    assert "engine_cores applies to CUDA engines; these run on the cpu, on any core" in log


@pytest.mark.gpu
def test_a_cuda_server_runs_its_engine_on_its_own_cores_and_the_workers_on_the_rest(tiny_model_dir, tmp_path):
    from export.pipeline import export_artifact
    export_artifact(tiny_model_dir, tmp_path / "art", device="cuda")
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 3:
        pytest.skip("needs 3 cores: 2 for the engine, 1 for the workers")
    cores, log = _serve_and_read_cores(tmp_path / "art", engine_cores=2, device="cuda")
    assert cores == {"engine": describe(frozenset(allowed[-2:])), "worker": describe(frozenset(allowed[:-2])),
                     "status": 200}, log
    assert f"engine process(es) on cores {describe(frozenset(allowed[-2:]))}" in log
