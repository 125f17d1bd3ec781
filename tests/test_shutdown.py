"""Stopping the server: SIGTERM under load drains (queued work answered until the drain deadline, the rest
503 + Retry-After in the error shape, never a 500 or a keep-alive connection closed under a request) and
exits 0, in one process and with HTTP workers; a `kill -9` of the launcher leaves no process and no
socket behind."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.test_server import start_server


@pytest.mark.slow
@pytest.mark.parametrize("workers, to_group", [(1, False), (2, False), (2, True)],
                         ids=["one-process", "workers", "workers-whole-group"])
def test_sigterm_under_load_drains_answers_503_past_the_deadline_and_exits_0(tiny_artifact_dir, workers, to_group):
    """to_group: the SIGTERM reaches every process of the server's group at once, as systemd, `timeout`
    and `kill -- -PGID` send it; the engine process must keep serving the workers' drain."""
    drain_s = 1.0
    # No admission limits: the queue must hold more work than the drain deadline allows.
    proc, base = start_server(tiny_artifact_dir, new_session=to_group, workers=workers, drain_seconds=drain_s,
                              max_queued_sequences=100_000, max_concurrent_requests=100_000, max_queue_ms="")
    texts = [f"text {i} of a request that keeps the engine busy " + "with many more words " * 20 for i in range(64)]
    answers, failures, stop = [], [], threading.Event()

    def client():
        with httpx.Client(timeout=60) as c:
            while not stop.is_set():
                try:
                    answers.append(c.post(f"{base}/embed", json={"inputs": texts}))
                except httpx.TransportError as e:  # after the listener closed: refused, or closed by the server
                    failures.append(e)
                    time.sleep(0.05)

    try:
        # 64 clients of 64 long texts: more queued work than 2 cores finish within drain_s on an idle machine
        # too (24 clients once drained in time, so no request met the deadline)
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            for _ in range(64):
                pool.submit(client)
            deadline = time.monotonic() + 60
            while len(answers) < 24 and time.monotonic() < deadline:  # answers flow; the queue stays full
                time.sleep(0.1)
            signalled = time.monotonic()
            if to_group:
                os.killpg(proc.pid, signal.SIGTERM)
            else:
                proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=drain_s + 30)
            stopped_after = time.monotonic() - signalled
            stop.set()
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    assert rc == 0, f"exit {rc}:\n{log[-3000:]}"
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log[-3000:]
    assert stopped_after < drain_s + 10, stopped_after
    statuses = [r.status_code for r in answers]
    assert statuses.count(200) >= 24, statuses  # answered before the signal
    # A keep-alive connection is not closed under a request: each client got a 503 with Connection: close
    # (or an answer), and then found the listener closed.
    assert all(isinstance(e, httpx.ConnectError) for e in failures), {type(e).__name__: str(e) for e in failures}
    assert 500 not in statuses and set(statuses) <= {200, 503}, sorted(set(statuses))
    past_deadline = 0
    for r in answers:
        if r.status_code == 503:
            error = r.json()["error"]
            assert error["type"] == "shutting_down", r.text  # never not_ready: the engine outlives the drain
            assert r.headers["retry-after"] == "1", r.text
            assert r.headers["connection"] == "close", r.headers  # the client's next request opens a new one
            past_deadline += "drain deadline" in error["message"]
    assert past_deadline > 0, (statuses.count(200), statuses.count(503))


def _children(pid: int) -> set[int]:
    """Every descendant of `pid` (from /proc)."""
    found, frontier = set(), [pid]
    while frontier:
        parent = frontier.pop()
        for task in Path(f"/proc/{parent}/task").iterdir():
            with open(task / "children") as f:
                kids = {int(k) for k in f.read().split()}
            frontier.extend(kids - found)
            found |= kids
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"  # a zombie has ended; its reaper is gone too
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")
def test_kill_9_of_the_launcher_leaves_no_process_and_no_socket(tiny_artifact_dir, short_tmp_dir, monkeypatch):
    env_tmp = short_tmp_dir
    monkeypatch.setenv("TMPDIR", str(env_tmp))
    proc, base = start_server(tiny_artifact_dir, workers=2)
    left = []
    try:
        assert httpx.post(f"{base}/embed", json={"inputs": "x"}, timeout=30).status_code == 200
        children = _children(proc.pid)
        assert len(children) >= 3, children  # the engine, two HTTP workers (and multiprocessing's resource tracker)
        assert list(env_tmp.glob("bertserve-run-*/engine0.sock"))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 15
        while any(_alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [c for c in children if _alive(c)]
    finally:
        if proc.poll() is None:
            proc.kill()
    for c in left:
        os.kill(c, signal.SIGKILL)
    assert left == [], f"still running after the launcher's kill -9: {left}"
    assert list(env_tmp.glob("bertserve-run-*")) == []
