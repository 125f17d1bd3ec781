"""The server as it is deployed: `python -m app` (the container's CMD) in a subprocess on a loopback
port, driven over real HTTP: every endpoint, concurrency, disconnects, overload, bad input, shutdown."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import shutil
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ [\w.]+: ")  # the server's one log format


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(artifact: Path, python: Path | str = sys.executable, cwd: Path | str = ROOT,
                 new_session: bool = False, ready_s: float = 60, **settings) -> tuple[subprocess.Popen, str]:
    """`python -m app` with BERTSERVE_* settings; returns the process and its base URL once /ready answers 200
    (within ready_s). new_session: in a process group of its own, as a terminal's Ctrl-C reaches it."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BERTSERVE_")}
    env.update({f"BERTSERVE_{k.upper()}": str(v) for k, v in settings.items()}, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([str(python), "-m", "app", "--model-dir", str(artifact), "--port", str(port)],
                            cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=new_session)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ready_s
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{proc.stdout.read()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/ready", timeout=1).status_code == 200:
                return proc, base
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"server not ready after {ready_s:g} s")
        time.sleep(0.1)


@contextlib.contextmanager
def running_server(artifact: Path, python: Path | str = sys.executable, cwd: Path | str = ROOT,
                   ready_s: float = 60, **settings):
    """start_server(); yields its base URL; stops it with SIGTERM and checks that it shut down gracefully."""
    proc, base = start_server(artifact, python, cwd, ready_s=ready_s, **settings)
    try:
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        log = proc.stdout.read()
    assert rc == 0 and "Application shutdown complete" in log, f"exit {rc}:\n{log}"


@pytest.fixture(scope="module")
def server(tiny_artifact_dir):
    with running_server(tiny_artifact_dir, max_wait_ms=5) as base:
        yield base


def metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_every_endpoint(server):
    with httpx.Client(base_url=server, timeout=30) as c:
        assert c.get("/health").json() == {"status": "ok"}
        assert c.get("/ready").json()["status"] == "ready"
        info = c.get("/info").json()
        assert info["dimensions"] == 128 and info["provider"] == "CPUExecutionProvider"
        assert c.get("/docs").status_code == 200
        assert {"/embed", "/nsp", "/tokenize", "/v1/embeddings"} <= set(c.get("/openapi.json").json()["paths"])
        embed = c.post("/embed", json={"inputs": ["a text", ["text a", "text b"]], "pooling": "mean",
                                       "return_tokens": True, "normalize": True})
        assert embed.status_code == 200 and len(embed.json()["data"]) == 2
        assert {"x-tokenize-ms", "x-queue-ms", "x-inference-ms"} <= set(embed.headers)
        assert embed.json()["data"][1]["tokens"][-1]["segment"] == 1
        assert 0 < c.post("/nsp", json={"pairs": [["a", "b"]]}).json()["data"][0]["is_next"] < 1
        assert c.post("/tokenize", json={"inputs": "東京 🚀"}).json()["data"][0]["tokens"][1]["token"] == "東"
        assert c.post("/v1/embeddings", json={"input": ["x", "y"], "model": "tiny"}).json()["object"] == "list"
        assert "bertserve_requests_total" in c.get("/metrics").text


def test_fifty_concurrent_clients_are_batched_and_correct(server):
    texts = [f"concurrent text {i} " + "more words " * (i % 7) for i in range(50)]

    async def go():
        async with httpx.AsyncClient(base_url=server, timeout=60) as c:
            alone = [(await c.post("/embed", json={"inputs": t})).json()["data"][0]["embedding"] for t in texts[:8]]
            before = metric(server, "bertserve_batch_size_count")
            rs = await asyncio.gather(*(c.post("/embed", json={"inputs": t}) for t in texts))
            return alone, rs, before
    alone, rs, before = asyncio.run(go())
    assert [r.status_code for r in rs] == [200] * 50
    for a, r in zip(alone, rs):
        np.testing.assert_allclose(r.json()["data"][0]["embedding"], a, atol=1e-5)
    batches = metric(server, "bertserve_batch_size_count") - before
    assert batches < 50, f"50 concurrent requests ran in {batches} batches: no batching happened"


def test_bad_inputs_get_clear_4xx_and_the_server_goes_on(server):
    with httpx.Client(base_url=server, timeout=60) as c:
        cases = [
            (c.post("/embed", content=b'{"inputs": "\xc3\x28"}'), 422),  # invalid UTF-8
            (c.post("/embed", content=b"{not json"), 422),
            (c.post("/embed", json={"inputs": 3}), 422),
            (c.post("/embed", json={"inputs": [""]}), 422),
            (c.post("/embed", json={"inputs": ["\u200b\x07"]}), 422),  # nothing a tokenizer keeps
            (c.post("/embed", json={"inputs": ["x"] * 10_000}), 413),
            (c.post("/embed", json={"inputs": "word " * 200_000, "truncate": False}), 413),
            (c.post("/embed", content=b"x" * (9 * 1024 * 1024)), 413),  # over max_request_bytes
            (c.get("/missing"), 404),
        ]
        for r, status in cases:
            assert r.status_code == status, (status, r.text[:300])
            assert set(r.json()["error"]) == {"type", "message"}
        ok = c.post("/embed", json={"inputs": ["emoji 🚀🔥", "CJK 東京都", "ctrl\x01chars\ttab", "word " * 200_000]})
        assert ok.status_code == 200 and len(ok.json()["data"]) == 4
        assert c.get("/ready").status_code == 200


def test_a_gzip_body_from_requests_is_served_and_a_gzip_bomb_refused(server):
    """A real server and client: a gzip body answers as the plain one; one that inflates past
    max_request_bytes (8 MB) is 413 though it comes in 9 KB; brotli is 415; the server goes on."""
    import gzip

    import requests

    plain = b'{"inputs": ["a compressed request", "and its second text"]}'
    bomb = gzip.compress(b'{"inputs": "' + b"x" * (9 * 1024 * 1024) + b'"}')
    headers = {"content-type": "application/json", "content-encoding": "gzip"}
    with requests.Session() as s:
        want = s.post(f"{server}/embed", data=plain, timeout=60)
        got = s.post(f"{server}/embed", data=gzip.compress(plain), headers=headers, timeout=60)
        too_big = s.post(f"{server}/embed", data=bomb, headers=headers, timeout=60)
        brotli = s.post(f"{server}/embed", data=plain, headers={"content-encoding": "br"}, timeout=60)
        after = s.post(f"{server}/embed", json={"inputs": "still serving"}, timeout=60)
    assert len(bomb) < 16 * 1024
    assert want.status_code == got.status_code == 200 and got.json()["data"] == want.json()["data"]
    assert too_big.status_code == 413 and too_big.json()["error"]["type"] == "payload_too_large", too_big.text
    assert brotli.status_code == 415 and brotli.json()["error"]["type"] == "unsupported_media_type", brotli.text
    assert after.status_code == 200


def test_a_trailing_slash_on_a_service_route_is_served_as_the_route(server):
    """POST /embed/ (a base URL given with a slash) is /embed, not Starlette's 307 to it: httpx and the openai
    client do not follow a redirect of a POST. Pages keep the redirect (a browser follows it)."""
    bodies = {"/embed": {"inputs": "hello world"}, "/tokenize": {"inputs": "hello world"},
              "/nsp": {"pairs": [["a", "b"]]}, "/v1/embeddings": {"input": "hello world"},
              "/embeddings": {"input": "hello world"}, "/tei/embed": {"inputs": "hello world"},
              "/invocations": {"inputs": "hello world"},
              "/similarity": {"inputs": {"source_sentence": "a", "sentences": ["a", "b"]}}}
    counted = 'bertserve_requests_total{endpoint="/embed",status="200"}'
    before = metric(server, counted)
    with httpx.Client(base_url=server, timeout=30) as c:
        for path, body in bodies.items():
            plain, slashed = c.post(path, json=body), c.post(path + "/", json=body)
            assert slashed.status_code == 200, (path, slashed.status_code, slashed.headers.get("location"))
            assert slashed.json() == plain.json(), path
        rerank = c.post("/rerank/", json={"query": "q", "texts": ["a"]})  # the route itself: no classifier head
        assert rerank.status_code == 400 and rerank.json()["error"]["type"] == "unsupported"
        assert c.get("/health/").status_code == 307
        assert c.get("/health/", follow_redirects=True).json() == {"status": "ok"}
        assert c.get("/docs/", follow_redirects=True).status_code == 200
    assert metric(server, counted) == before + 2  # /embed/ counted as /embed


def test_disconnects_and_overload(tiny_artifact_dir):
    """A batcher that waits 1 s for company: queued work sits still long enough to observe."""
    with running_server(tiny_artifact_dir, max_wait_ms=1000, max_queued_sequences=4) as base:
        port = int(base.rsplit(":", 1)[1])
        # A client that sends its request and hangs up: its 3 sequences never reach the engine.
        body = b'{"inputs": ["gone", "before", "answer"]}'
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            time.sleep(0.3)
        # A client that hangs up halfway through its body.
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /embed HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"inputs\": ")
        deadline = time.monotonic() + 10
        while metric(base, "bertserve_dropped_sequences_total") < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(base, "bertserve_dropped_sequences_total") == 3
        assert metric(base, "bertserve_sequences_total") == 0

        async def overload():
            async with httpx.AsyncClient(base_url=base, timeout=30) as c:
                return await asyncio.gather(*(c.post("/embed", json={"inputs": ["a", "b"]}) for _ in range(3)))
        rs = asyncio.run(overload())
        assert sorted(r.status_code for r in rs) == [200, 200, 429]
        refused = next(r for r in rs if r.status_code == 429)
        assert refused.json()["error"]["type"] == "overloaded" and int(refused.headers["retry-after"]) >= 1
        assert httpx.post(f"{base}/embed", json={"inputs": "still fine"}, timeout=30).status_code == 200


def test_several_workers_share_one_engine_process_and_sum_their_metrics(server, tiny_artifact_dir, tmp_path,
                                                                        monkeypatch):
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    (metrics_dir / "counter_99999.db").write_bytes(b"left by an earlier run")  # must be wiped, not summed
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(metrics_dir))
    texts = [f"text {i} " + "more words " * (i % 5) for i in range(40)]
    with running_server(tiny_artifact_dir, workers=2) as base:
        # Each worker writes its model gauge once connected to the engine: one file per process id.
        # /ready answered as soon as one worker was up (connections go only to workers that are ready).
        deadline = time.monotonic() + 60
        while len(pids := {p.stem.rsplit("_", 1)[1] for p in metrics_dir.glob("gauge_max_*.db")}) < 2:
            assert time.monotonic() < deadline, f"workers up: {pids}"
            time.sleep(0.1)
        assert "99999" not in {p.stem.rsplit("_", 1)[1] for p in metrics_dir.glob("*.db")}

        async def load():
            async with httpx.AsyncClient(base_url=base, timeout=60, limits=httpx.Limits(max_connections=32)) as c:
                rs = await asyncio.gather(*(c.post("/embed", json={"inputs": [t, "two"]}) for t in texts))
                infos = [(await c.get("/info")).json() for _ in range(4)]
            return rs, infos
        rs, infos = asyncio.run(load())
        assert [r.status_code for r in rs] == [200] * 40
        assert all(i["limits"]["workers"] == 2 and str(i["pid"]) in pids for i in infos)
        assert len({i["engine_pid"] for i in infos}) == 1 and str(infos[0]["engine_pid"]) not in pids
        assert metric(base, 'bertserve_requests_total{endpoint="/embed",status="200"}') == 40
        assert metric(base, "bertserve_sequences_total") == 80  # counted by the engine process
        groups = metric(base, 'bertserve_engine_link_duration_seconds_count{way="to_engine"}')
        assert 1 <= groups <= 40  # a worker sends the requests of one event-loop turn as one group
        for way in ("to_engine", "in_engine", "from_engine"):  # each group's hops, timed on one clock
            label = f'{{way="{way}"}}'
            assert metric(base, "bertserve_engine_link_duration_seconds_count" + label) == groups, way
            assert 0 <= metric(base, "bertserve_engine_link_duration_seconds_sum" + label) < groups * 60, way
    # The same vectors as one process serving alone.
    single = httpx.post(f"{server}/embed", json={"inputs": texts[:8]}, timeout=30).json()["data"]
    for r, one in zip(rs, single):
        np.testing.assert_allclose(r.json()["data"][0]["embedding"], one["embedding"], atol=1e-5)


def test_requests_a_worker_gathers_are_never_refused_as_one_request_too_large(tiny_artifact_dir):
    """An HTTP worker sends the requests of one event-loop turn to the engine as one group. Each of these fits
    max_queued_sequences; gathered, they must not be refused as one request past it (413 "send fewer per
    request", which clients do not retry): each is served, or refused 429 while the queue is full."""
    async def bursts(base):
        async with httpx.AsyncClient(base_url=base, timeout=60, limits=httpx.Limits(max_connections=16)) as c:
            rs = []
            for _ in range(5):
                rs += await asyncio.gather(*(c.post("/embed", json={"inputs": [f"text {i} {j}" for j in range(30)]})
                                             for i in range(8)))
            return rs
    with running_server(tiny_artifact_dir, workers=2, max_queued_sequences=50) as base:
        rs = asyncio.run(bursts(base))
    assert {r.status_code for r in rs} <= {200, 429}, {r.text for r in rs if r.status_code not in (200, 429)}
    assert any(r.status_code == 200 for r in rs)


def test_one_process_given_a_metrics_folder_counts_its_own_run_only(tiny_artifact_dir, tmp_path, monkeypatch):
    """PROMETHEUS_MULTIPROC_DIR set for the server, as with workers: the folder is made when missing, and
    what an earlier run left there is not summed into a restarted server's metrics."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "metrics"))
    embedded = 'bertserve_requests_total{endpoint="/embed",status="200"}'
    for _ in range(2):
        with running_server(tiny_artifact_dir) as base:
            assert metric(base, embedded) == 0
            assert httpx.post(f"{base}/embed", json={"inputs": "a text"}, timeout=30).status_code == 200
            assert metric(base, embedded) == 1


def test_one_engine_process_per_gpu_with_the_workers_shared_out(tiny_artifact_dir):
    """cuda_device_ids: one engine process per device, worker i on engine i mod their number. Without a GPU
    here, both engines run on the CPU (device auto): the plumbing is what is checked."""
    with running_server(tiny_artifact_dir, workers=4, cuda_device_ids="0,1") as base:
        seen = {}  # worker pid -> engine pids it answered with
        deadline = time.monotonic() + 60
        while len(seen) < 4 and time.monotonic() < deadline:
            info = httpx.get(f"{base}/info", timeout=30).json()  # a new connection: the next worker in turn
            seen.setdefault(info["pid"], set()).add(info["engine_pid"])
        r = httpx.post(f"{base}/embed", json={"inputs": ["a", "b"]}, timeout=30)
    assert len(seen) == 4, seen
    assert all(len(engines) == 1 for engines in seen.values())  # a worker keeps its engine
    engines = [e for es in seen.values() for e in es]
    assert len(set(engines)) == 2 and sorted(engines.count(e) for e in set(engines)) == [2, 2]
    assert r.status_code == 200


@pytest.mark.parametrize("settings,words", [({"workers": 1, "cuda_device_ids": "0,1"}, "workers must be at least"),
                                            ({"workers": 2, "cuda_device_ids": "0;1"}, "cuda_device_ids")])
def test_several_gpus_need_as_many_workers(tiny_artifact_dir, settings, words):
    env = {**os.environ, **{f"BERTSERVE_{k.upper()}": str(v) for k, v in settings.items()}}
    r = subprocess.run([sys.executable, "-m", "app", "--model-dir", str(tiny_artifact_dir)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and words in r.stderr, r.stderr


def test_workers_get_connections_in_turn(tiny_artifact_dir):
    """Keep-alive connections opened in a burst are spread evenly over the workers (where a shared
    listening socket gave one worker most of them), so pooled clients load every worker alike."""
    with running_server(tiny_artifact_dir, workers=3) as base:
        # /ready answers once one worker serves; connections go only to ready workers, so first see all three
        seen, deadline = set(), time.monotonic() + 60
        while len(seen) < 3 and time.monotonic() < deadline:
            seen.add(httpx.get(f"{base}/info", timeout=30).json()["pid"])  # a new connection: the next worker
        assert len(seen) == 3, seen

        async def pids_of_connections(count: int) -> list[int]:
            clients = [httpx.AsyncClient(base_url=base, timeout=30) for _ in range(count)]  # one connection each
            try:
                return [r.json()["pid"] for r in await asyncio.gather(*(c.get("/info") for c in clients))]
            finally:
                await asyncio.gather(*(c.aclose() for c in clients))

        pids = asyncio.run(pids_of_connections(12))
    assert sorted(pids.count(p) for p in set(pids)) == [4, 4, 4], pids


def test_a_dead_http_worker_is_replaced(tiny_artifact_dir):
    """A worker killed mid-service costs its own connections only: the others keep answering, a new
    worker takes its place, and every answer stays right."""
    with running_server(tiny_artifact_dir, workers=2) as base:
        victim = httpx.get(f"{base}/info", timeout=10).json()["pid"]
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 60
        pids: set[int] = set()
        while len(pids - {victim}) < 2:  # both workers answer again, one of them new
            assert time.monotonic() < deadline, f"workers answering: {pids}"
            with httpx.Client(base_url=base, timeout=30) as c:  # a new connection, in turn to each worker
                with contextlib.suppress(httpx.TransportError):
                    r = c.post("/embed", json={"inputs": "still serving"})
                    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == 128
                    pids.add(c.get("/info").json()["pid"])
        assert victim not in pids


def test_a_worker_started_after_an_export_into_the_served_folder_keeps_the_engines_model(tiny_artifact_dir, tmp_path):
    """An export into the folder being served (another tokenizer and model), then a worker lost: its
    replacement tokenises as the engine's graph was trained, not with the new tokenizer.json; the new
    model is served after a restart, as in one process."""
    import torch

    from export.pipeline import export_artifact
    from tests.conftest import SAMPLE_TEXT
    from training.model import BertForPreTraining, preset_config
    from training.model_folder import save_model_folder
    from training.wordpiece import save_tokenizer, train_wordpiece

    save_tokenizer(train_wordpiece([t.upper() for t in SAMPLE_TEXT], vocab_size=200, min_frequency=1,
                                   lowercase=False), tmp_path / "tokenizer")
    torch.manual_seed(1)
    vocab = json.loads((tmp_path / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
    model = BertForPreTraining(preset_config("tiny", vocab_size=len(vocab), max_position_embeddings=128))
    other = tmp_path / "other"
    export_artifact(save_model_folder(model, tmp_path / "tokenizer", tmp_path / "model"), other, device="cpu")
    served = tmp_path / "served"
    shutil.copytree(tiny_artifact_dir, served)
    text = "The Quick brown fox: naïve café"

    def answers(c: httpx.Client) -> tuple[dict, list[float], int]:
        ids = c.post("/tokenize", json={"inputs": text}).json()
        vector = c.post("/embed", json={"inputs": text}).json()["data"][0]["embedding"]
        return ids, vector, c.get("/info").json()["pid"]

    with running_server(served, workers=2) as base:
        with httpx.Client(base_url=base, timeout=30) as c:
            ids, vector, victim = answers(c)
        shutil.rmtree(served)
        shutil.copytree(other, served)
        os.kill(victim, signal.SIGKILL)
        deadline, pids = time.monotonic() + 60, set()
        while len(pids - {victim}) < 2:  # both workers answer, one of them started after the export
            assert time.monotonic() < deadline, f"workers answering: {pids}"
            with httpx.Client(base_url=base, timeout=30) as c, contextlib.suppress(httpx.TransportError):
                got_ids, got_vector, pid = answers(c)
                assert got_ids == ids and np.allclose(got_vector, vector, atol=1e-6), (pid, got_ids, ids)
                pids.add(pid)
    with running_server(served) as base:  # restarted: the new model
        assert httpx.post(f"{base}/tokenize", json={"inputs": text}, timeout=30).json() != ids


def _serving_a_request(base: str) -> bool:
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    return any(line.startswith("bertserve_inflight_requests ") and float(line.split()[1]) >= 1
               for line in metrics.splitlines())


def test_ctrl_c_lets_the_workers_answer_then_stops_every_process(tiny_artifact_dir):
    """Ctrl-C reaches the launcher, the workers and the engine process at once: the engine keeps going
    until the workers have answered what they hold, and all exit cleanly."""
    # A drain deadline longer than the request can take on a busy machine: the default 5 s would answer
    # it 503 there, which tests/test_shutdown.py covers.
    proc, base = start_server(tiny_artifact_dir, new_session=True, workers=2, drain_seconds=60)
    texts = [f"request in flight {i} " + "with many more words " * 20 for i in range(512)]
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, f"{base}/embed", json={"inputs": texts}, timeout=60)
            deadline = time.monotonic() + 30
            while not _serving_a_request(base):  # the request has reached a worker: Ctrl-C comes mid-request
                assert time.monotonic() < deadline and not answer.done(), "the request was never seen in flight"
                time.sleep(0.01)
            os.killpg(proc.pid, signal.SIGINT)
            r = answer.result()
        rc = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    assert r.status_code == 200 and len(r.json()["data"]) == 512, r.text[:300]
    assert rc == 0 and "Traceback" not in log and "lost the engine" not in log, f"exit {rc}:\n{log}"
    assert f"listening on {base}: 2 HTTP workers, 1 engine process(es)" in log, log  # where to send requests


@pytest.mark.parametrize("after_engine_ready_s", [0.0, 0.7])
def test_ctrl_c_while_the_workers_start_stops_every_process_cleanly(tiny_artifact_dir, after_engine_ready_s):
    """Ctrl-C that comes while the HTTP workers are still importing or building their app: every process
    stops without a traceback, as when it comes once they serve."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BERTSERVE_")}
    env.update(BERTSERVE_WORKERS="2", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "app", "--model-dir", str(tiny_artifact_dir),
                             "--port", str(free_port())], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    log = []
    try:
        for line in proc.stdout:  # the workers are spawned once the engine is ready
            log.append(line)
            if "engine process" in line and "ready" in line:
                break
        time.sleep(after_engine_ready_s)
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = "".join(log) + proc.stdout.read()
    assert "engine process" in text, text
    assert rc == 0 and "Traceback" not in text and "KeyboardInterrupt" not in text, f"exit {rc}:\n{text}"


@pytest.mark.parametrize("after_start_s", [0.3, 1.0])  # importing its modules, loading the model
def test_ctrl_c_while_a_single_process_server_starts_is_one_quiet_exit(tiny_artifact_dir, after_start_s):
    env = {k: v for k, v in os.environ.items() if not k.startswith("BERTSERVE_")}
    proc = subprocess.Popen([sys.executable, "-m", "app", "--model-dir", str(tiny_artifact_dir),
                             "--port", str(free_port())], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    time.sleep(after_start_s)
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=60)
    text = proc.stdout.read()
    assert rc in (0, 130) and "Traceback" not in text, f"exit {rc}:\n{text}"


def test_workers_run_folder_is_temporary(tiny_artifact_dir, short_tmp_dir, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(short_tmp_dir))
    with running_server(tiny_artifact_dir, workers=2) as base:
        assert httpx.post(f"{base}/embed", json={"inputs": "x"}, timeout=30).status_code == 200
        assert len(list(short_tmp_dir.glob("bertserve-run-*/metrics/*.db"))) > 0
    assert list(short_tmp_dir.glob("bertserve-run-*")) == []


def test_a_long_tmpdir_still_serves_with_workers(tiny_artifact_dir, short_tmp_dir, monkeypatch):
    """A Unix socket's path has room for 107 bytes: under a longer TMPDIR the run folder goes to /tmp."""
    deep = short_tmp_dir / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    monkeypatch.setenv("TMPDIR", str(deep))
    with running_server(tiny_artifact_dir, workers=2) as base:
        assert httpx.post(f"{base}/embed", json={"inputs": "x"}, timeout=30).status_code == 200


def test_a_dead_engine_process_stops_the_server(tiny_artifact_dir):
    """Without its engine nothing can be answered: the server exits non-zero for its supervisor to restart."""
    proc, base = start_server(tiny_artifact_dir, workers=2)
    try:
        os.kill(httpx.get(f"{base}/info", timeout=10).json()["engine_pid"], signal.SIGKILL)
        assert proc.wait(timeout=30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    assert "the engine process exited" in log, log


def test_openai_client(server):
    import openai  # a dev dependency: the real client against the real server
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused")
    r = client.embeddings.create(model="tiny", input=["hello world", "second text"])  # base64 by default
    assert [d.index for d in r.data] == [0, 1] and len(r.data[0].embedding) == 128
    embed = httpx.post(f"{server}/embed", json={"inputs": ["hello world"]}).json()  # the model's default pooling
    np.testing.assert_allclose(r.data[0].embedding, embed["data"][0]["embedding"], atol=1e-6)
    floats = client.embeddings.create(model="tiny", input="hello world", encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, r.data[0].embedding, atol=1e-6)
    bare = openai.OpenAI(base_url=server, api_key="unused")  # /embeddings, as TEI and infinity also serve it
    np.testing.assert_allclose(bare.embeddings.create(model="tiny", input="hello world").data[0].embedding,
                               r.data[0].embedding, atol=1e-6)
    assert r.usage.prompt_tokens > 0
    # LangChain's OpenAIEmbeddings sends 1,000 texts a request by default (OpenAI takes up to 2,048)
    chunk = client.embeddings.create(model="tiny", input=[f"text number {i}" for i in range(1000)])
    assert [d.index for d in chunk.data] == list(range(1000))
    info = httpx.get(f"{server}/info").json()
    for c in (client, bare):  # where OpenAI-compatible tools look for the model's name
        listed = c.models.list().data
        assert [m.id for m in listed] == [info["model"]] and listed[0].created > 1.7e9
        assert c.models.retrieve(info["model"]) == listed[0]
        with pytest.raises(openai.NotFoundError, match="any model name"):
            c.models.retrieve("text-embedding-3-small")
    for path in ("/health", "/ping", "/ready", "/info", "/metrics", "/"):  # load balancers' checks send HEAD too
        head, get = httpx.head(f"{server}{path}"), httpx.get(f"{server}{path}")
        assert head.status_code == 200 and head.content == b"", (path, head.status_code)
        assert head.headers["content-type"] == get.headers["content-type"], path
    with pytest.raises(openai.BadRequestError, match="check_embedding_ctx_length"):
        client.embeddings.create(model="tiny", input=[[101, 2023, 102]])  # ids from another tokenizer


def test_sentence_vectors_pooled_from_token_vectors_are_served_past_max_token_vectors(tiny_artifact_dir):
    """max_token_vectors bounds the token vectors an answer carries. A mean- or max-pooled vector is computed
    from token vectors the answer does not carry: LangChain's 1,000 texts a request to a mean-pooling model
    (every sentence-transformers model's default) are served, as are the same texts' max-pooled vectors on
    /embed; asking for their token vectors is still refused."""
    import openai
    texts = [f"sentence number {i} of a document split into chunks for search" for i in range(1000)]
    with running_server(tiny_artifact_dir, openai_pooling="mean") as base:
        tokens = httpx.post(f"{base}/tokenize", json={"inputs": texts}, timeout=30).json()["usage"]["tokens"]
        assert tokens > 16_384  # the default max_token_vectors
        chunk = openai.OpenAI(base_url=f"{base}/v1", api_key="unused").embeddings.create(model="tiny", input=texts)
        assert [d.index for d in chunk.data] == list(range(1000)) and chunk.usage.prompt_tokens == tokens
        alone = httpx.post(f"{base}/embed", json={"inputs": texts[-1], "pooling": "mean", "normalize": False},
                           timeout=30).json()["data"][0]["embedding"]
        np.testing.assert_allclose(chunk.data[-1].embedding, alone, atol=1e-5)  # the tiny model's: not normalised
        pooled = httpx.post(f"{base}/embed", json={"inputs": texts, "pooling": "max"}, timeout=60)
        assert pooled.status_code == 200 and len(pooled.json()["data"]) == 1000
        with_tokens = httpx.post(f"{base}/embed", json={"inputs": texts, "pooling": "max", "return_tokens": True},
                                 timeout=30)
        assert with_tokens.status_code == 413 and "max_token_vectors" in with_tokens.json()["error"]["message"]


def test_openai_client_retrieves_a_model_named_as_on_the_hub(tiny_artifact_dir):
    """A Hub-style name (ORG/NAME, as a Hugging Face cache snapshot or --model-name gives) has a slash:
    models.retrieve asks for /v1/models/ORG/NAME, which the route must take whole."""
    import openai

    with running_server(tiny_artifact_dir, model_name="acme/tiny-bert") as base:
        for url in (f"{base}/v1", base):
            client = openai.OpenAI(base_url=url, api_key="unused")
            listed = client.models.list().data
            assert [m.id for m in listed] == ["acme/tiny-bert"]
            assert client.models.retrieve("acme/tiny-bert") == listed[0]
            with pytest.raises(openai.NotFoundError, match="acme/other"):
                client.models.retrieve("acme/other")
        assert httpx.get(f"{base}/v1/models/acme%2Ftiny-bert", timeout=10).json()["id"] == "acme/tiny-bert"


def test_huggingface_inference_client_as_against_text_embeddings_inference(tiny_artifact_dir):
    """huggingface_hub's InferenceClient (what LangChain's HuggingFaceEndpointEmbeddings and Haystack's TEI
    embedders call) pointed at the server's URL, as at a text-embeddings-inference server; with HTTP workers,
    whose fast path serves the route."""
    from huggingface_hub import InferenceClient  # a dev dependency: the real client against the real server
    from huggingface_hub.errors import HfHubHTTPError

    with running_server(tiny_artifact_dir, workers=2) as base:
        client = InferenceClient(base)
        one = client.feature_extraction("hello world")
        many = client.feature_extraction(["hello world", "second text"], normalize=False, truncate=True,
                                         truncation_direction="left", dimensions=32)
        similar = client.sentence_similarity("hello world", ["hello world", "second text", "a third one"])
        embed = httpx.post(f"{base}/embed", json={"inputs": ["hello world", "second text", "a third one"]}).json()
        with pytest.raises(HfHubHTTPError) as too_long:
            client.feature_extraction("word " * 1000, truncate=False)
        sagemaker = httpx.post(f"{base}/invocations", json={"inputs": "hello world"}), httpx.get(f"{base}/ping")
    want = np.array([d["embedding"] for d in embed["data"]])  # the model's default pooling, not normalised
    assert one.shape == (1, 128) and one.dtype == np.float32
    np.testing.assert_allclose(one[0], want[0] / np.linalg.norm(want[0]), atol=1e-6)
    np.testing.assert_allclose(many, want[:2, :32], atol=1e-6)
    unit = want / np.linalg.norm(want, axis=1, keepdims=True)
    np.testing.assert_allclose(similar, unit @ unit[0], atol=1e-5)  # TEI's similarity: cosines, in order
    assert too_long.value.response.status_code == 413 and "input_too_long" in too_long.value.response.text
    np.testing.assert_allclose(sagemaker[0].json(), one, atol=1e-6)  # SageMaker's paths, as TEI serves them
    assert sagemaker[1].status_code == 200


def test_text_embeddings_inference_paths_under_tei(tiny_artifact_dir):
    """TEI's own paths under /tei, for clients that call them by name where /embed answers in this server's
    shape: llama-index's TextEmbeddingsInference posts {"inputs", "truncate"} to BASE/embed and reads
    [[float, ...], ...]; InferenceClient given URL/tei posts to it as to TEI's root. With HTTP workers, whose
    fast path serves the routes, and through one process's FastAPI routes."""
    from huggingface_hub import InferenceClient  # a dev dependency: the real client against the real server

    texts = ["hello world", "second text", "a third one"]
    for workers in (2, 1):
        with running_server(tiny_artifact_dir, workers=workers) as base:
            embed = httpx.post(f"{base}/tei/embed", json={"inputs": texts, "truncate": True})
            root = httpx.post(base, json={"inputs": texts}).json()
            client = InferenceClient(f"{base}/tei").feature_extraction(texts)
            raw = httpx.post(f"{base}/tei/embed", json={"inputs": "hello world", "normalize": False}).json()
            all_tokens = httpx.post(f"{base}/tei/embed_all", json={"inputs": texts[:2]}).json()
            ours = httpx.post(f"{base}/embed", json={"inputs": texts, "pooling": "none", "return_tokens": True}).json()
            similar = [httpx.post(f"{base}{path}/similarity", json={"inputs": {"source_sentence": texts[0],
                                                                              "sentences": texts}}).json()
                       for path in ("", "/tei")]
            rerank = httpx.post(f"{base}/tei/rerank", json={"query": "q", "texts": texts})
            unknown = httpx.post(f"{base}/tei/decode", json={"ids": [1, 2]})
        assert embed.status_code == 200 and np.array(embed.json()).shape == (3, 128)
        np.testing.assert_allclose(embed.json(), root, atol=1e-6)
        np.testing.assert_allclose(client, root, atol=1e-6)
        norm = np.linalg.norm(raw[0])  # normalize false: the default pooling's own vector
        assert abs(norm - 1) > 1e-3 and np.allclose(raw[0] / norm, root[0], atol=1e-5)
        assert len(all_tokens) == 2
        for got, want in zip(all_tokens, ours["data"]):
            assert len(got) == len(want["tokens"])  # [CLS] ... [SEP], every token
            np.testing.assert_allclose(got, want["token_embeddings"], atol=1e-6)
        np.testing.assert_allclose(similar[1], similar[0], atol=1e-6)
        assert rerank.status_code == 400 and rerank.json()["error"]["type"] == "unsupported"  # no classifier head
        assert unknown.status_code == 404


@pytest.mark.parametrize("args,env,words", [
    (["--model-dir", "/nonexistent/no-artifact-here"], {}, "model_dir (--model-dir, BERTSERVE_MODEL_DIR): "),
    (["--port", "0"], {}, "port (--port, BERTSERVE_PORT): "),
    ([], {"BERTSERVE_DEVICE": "tpu"}, "device (--device, BERTSERVE_DEVICE): "),
    ([], {"BERTSERVE_MAX_BATCH_TOKENS": "lots"}, "max_batch_tokens (--max-batch-tokens, BERTSERVE_MAX_BATCH_TOKENS): "),
    ([], {"BERTSERVE_API_KEY": " \n"}, "BERTSERVE_API_KEY): Value error, the key is only whitespace"),  # not "no key"
    # Kubernetes' variable for a Service named bertserve, over the image's BERTSERVE_PORT
    ([], {"BERTSERVE_PORT": "tcp://10.96.0.10:80"}, "BERTSERVE_PORT): Value error, 'tcp://10.96.0.10:80' is the "
                                                     "address Kubernetes gives pods for a Service named bertserve"),
])
def test_bad_settings_stop_the_server_at_once(tiny_artifact_dir, args, env, words):
    """In one line, naming the setting as a flag and as a variable (whichever way it was given)."""
    cmd = [sys.executable, "-m", "app", "--model-dir", str(tiny_artifact_dir), *args]
    r = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("bad settings: ") and words in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_device_or_operators_this_machine_cannot_run_stop_the_server_in_one_line(tiny_artifact_dir):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has the CUDA provider")
    for args, words in ((["--device", "cuda"], "has no CUDAExecutionProvider"),
                        (["--custom-kernels", "on"], "run on CUDA only")):
        cmd = [sys.executable, "-m", "app", "--model-dir", str(tiny_artifact_dir), "--port", "1", *args]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and words in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "cannot serve" in r.stderr, r.stderr


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("damage", ["tokenizer", "graph", "width"])
def test_an_artifact_whose_files_match_their_hashes_but_cannot_serve_stops_the_server_in_one_line(
        tiny_artifact_dir, tmp_path, damage, workers):
    """Files whose sha256 the manifest was made to match (a hand-edited artifact, a bug in another exporter)
    get past the hash check: what cannot be loaded from them is said in one line, with no traceback, and
    the server exits."""
    import json
    import shutil

    from artifact.manifest import sha256_file

    art = Path(shutil.copytree(tiny_artifact_dir, tmp_path / "art"))
    manifest = json.loads((art / "manifest.json").read_text())
    if damage == "tokenizer":
        (art / "tokenizer.json").write_text('{"version": "1.0", "model": "WordPiece"}')
        expected = f"{art / 'tokenizer.json'} cannot be read as a tokenizer"  # the user's file, in every mode
    elif damage == "graph":
        (art / "model.onnx").write_bytes(b"not a protobuf")
        expected = "onnxruntime could not load model.onnx"
    else:
        manifest["hidden_size"] = -manifest["hidden_size"]
        expected = "manifest hidden_size -128 is not a positive number"
    manifest["files_sha256"] = {name: sha256_file(art / name) for name in manifest["files_sha256"]}
    (art / "manifest.json").write_text(json.dumps(manifest))
    env = {k: v for k, v in os.environ.items() if not k.startswith("BERTSERVE_")}
    r = subprocess.run([sys.executable, "-m", "app", "--model-dir", str(art), "--port", str(free_port()),
                        "--workers", workers, "--precision", "fp32"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    said = [line for line in r.stderr.splitlines() if "cannot serve" in line]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert len(said) == 1 and f"cannot serve {art}: " in said[0] and expected in said[0], r.stderr
    assert "engine process" not in r.stderr, r.stderr  # no second line saying that the engine ended


def test_a_port_already_taken_stops_the_server_in_one_line_before_the_model_loads(tiny_artifact_dir):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        for workers in ("1", "2"):
            cmd = [sys.executable, "-m", "app", "--model-dir", str(tiny_artifact_dir), "--port", str(port),
                   "--workers", workers]
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert r.returncode == 2 and f"cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr
            assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_help_lists_every_public_setting_and_no_internal_one():
    from app.settings import Settings

    r = subprocess.run([sys.executable, "-m", "app", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    flags = {name: "--" + name.replace("_", "-") for name in Settings.model_fields}
    assert all(flag in r.stdout for flag in flags.values()), r.stdout
    assert "--engine-socket" not in r.stdout  # the launcher tells its HTTP workers through the environment
    r = subprocess.run([sys.executable, "-m", "app", "--engine-socket", "/tmp/x"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "unrecognized arguments: --engine-socket" in r.stderr, r.stderr


def test_a_folder_that_is_not_an_artifact_is_refused(tmp_path):
    r = subprocess.run([sys.executable, "-m", "app", "--model-dir", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "manifest.json" in r.stderr, r.stderr


@pytest.mark.parametrize("name", ["model.onnx", "tokenizer.json"])
def test_a_file_changed_since_export_is_refused(tiny_artifact_dir, tmp_path, name):
    """Bytes overwritten in place (same size, the manifest untouched): the server must not start on them."""
    import shutil

    artifact = tmp_path / "artifact"
    shutil.copytree(tiny_artifact_dir, artifact)
    with open(artifact / name, "r+b") as f:
        f.seek((artifact / name).stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    r = subprocess.run([sys.executable, "-m", "app", "--model-dir", str(artifact), "--port", str(free_port())],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip()
    assert "\n" not in err and str(artifact / name) in err and "changed or damaged" in err, err


@pytest.mark.parametrize("case,name,words", [
    ("truncated", "model.onnx", "changed or damaged"),
    ("corrupt", "tokenizer.json", "changed or damaged"),
    ("missing", "model_int8.onnx", "lacks model_int8.onnx"),
    ("missing", "tokenizer.json", "lacks tokenizer.json"),
])
def test_a_damaged_or_missing_file_is_one_line_naming_it(tiny_artifact_dir, tmp_path, case, name, words):
    import shutil

    artifact = tmp_path / "artifact"
    shutil.copytree(tiny_artifact_dir, artifact)
    path = artifact / name
    if case == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif case == "corrupt":
        path.write_text('{"version": "1.0", "model": ')
    else:
        path.unlink()
    r = subprocess.run([sys.executable, "-m", "app", "--model-dir", str(artifact), "--port", str(free_port())],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    err = r.stderr.strip()
    assert r.returncode == 2 and "\n" not in err and name in err and words in err, err


@pytest.mark.parametrize("case,words", [
    ("list", "manifest is a JSON list"),
    ("no_graphs", "manifest names no graph"),
    ("bad_length", "max_length -5"),
    ("no_int8", "no int8 graph (it has fp32); export one with `python -m export --int8`"),
    ("length_text", "max_length is 'abc', not int"),
    ("graphs_list", "malformed"),
    ("unhashed", "has no sha256 of model.onnx"),
    ("no_fp32", "no fp32 graph, only int8: serve it with --precision int8"),
    ("pooled_no_pooler", "default_pooling 'pooled' names BERT's pooler, but the model has none"),
    ("scoring_alone", "classifier_scoring 'sigmoid' is not one of auto, sigmoid, logits, or not auto without"),
])
def test_a_broken_manifest_or_missing_graph_is_one_line(tiny_artifact_dir, tmp_path, case, words):
    import json
    import shutil

    artifact = tmp_path / "artifact"
    shutil.copytree(tiny_artifact_dir, artifact)
    manifest = json.loads((artifact / "manifest.json").read_text())
    edited = {"list": [], "no_graphs": {**manifest, "graphs": {}}, "bad_length": {**manifest, "max_length": -5},
              "no_int8": {**manifest, "graphs": {k: v for k, v in manifest["graphs"].items() if k != "int8"}},
              "length_text": {**manifest, "max_length": "abc"}, "graphs_list": {**manifest, "graphs": []},
              "unhashed": {**manifest, "files_sha256": {"tokenizer.json": manifest["files_sha256"]["tokenizer.json"]}},
              "no_fp32": {**manifest, "graphs": {k: v for k, v in manifest["graphs"].items() if k != "fp32"}},
              "pooled_no_pooler": {**manifest, "default_pooling": "pooled", "has_pooler": False},
              "scoring_alone": {**manifest, "classifier_scoring": "sigmoid"}}[case]
    (artifact / "manifest.json").write_text(json.dumps(edited))
    flags = ["--precision", "int8", "--device", "cpu"] if case == "no_int8" else []
    r = subprocess.run([sys.executable, "-m", "app", "--model-dir", str(artifact), "--port", str(free_port()), *flags],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    err = r.stderr.strip()
    named = artifact if case in ("no_int8", "no_fp32") else artifact / "manifest.json"
    assert r.returncode == 2 and "\n" not in err and words in err and str(named) in err, err


def test_an_openai_pooling_the_model_cannot_serve_is_one_line_at_start_up(tiny_artifact_dir, tmp_path):
    """--openai-pooling pooled on a model without BERT's pooler: refused before serving, in one line that says
    what to set, where it used to start and answer every /v1/embeddings request 400; by the launcher with one
    or two workers, and by the app's own start-up in one process."""
    import json
    import shutil

    artifact = tmp_path / "artifact"
    shutil.copytree(tiny_artifact_dir, artifact)
    manifest = json.loads((artifact / "manifest.json").read_text())
    (artifact / "manifest.json").write_text(json.dumps({**manifest, "has_pooler": False, "has_nsp_head": False}))
    for workers in ("1", "2"):
        r = subprocess.run([sys.executable, "-m", "app", "--model-dir", str(artifact), "--port", str(free_port()),
                            "--openai-pooling", "pooled", "--workers", workers],
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
        err = r.stderr.strip()
        assert r.returncode == 2 and "\n" not in err and str(artifact) in err, err
        assert "openai_pooling 'pooled' names BERT's pooler, but this model has none" in err, err
    # in one process (create_app, as `uvicorn --factory` or an embedding host runs it): the lifespan refuses
    from app.engine import EngineError
    from tests.test_app import run, serving

    async def start():
        async with serving(artifact, openai_pooling="pooled"):
            pass
    with pytest.raises(EngineError, match="openai_pooling 'pooled' names BERT's pooler, but this model has none"):
        run(start())


def test_fp16_asked_of_a_cpu_artifact_is_one_line_that_says_what_to_do(tiny_artifact_dir):
    """`--precision fp16` (device auto) on the CPU artifact: without CUDA the line says what the CPU runs,
    not to export an fp16 graph (which needs a GPU); with CUDA, how to export one."""
    import onnxruntime as ort

    r = subprocess.run([sys.executable, "-m", "app", "--model-dir", str(tiny_artifact_dir), "--port", str(free_port()),
                        "--precision", "fp16"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    err = r.stderr.strip()
    expected = ("no fp16 graph (it has fp32, int8); export one on a GPU with `python -m export --device cuda`"
                if "CUDAExecutionProvider" in ort.get_available_providers() else
                "the fp16 graph runs on CUDA only; use precision fp32 or int8 on the CPU")
    assert r.returncode == 2 and "\n" not in err and expected in err, err


@pytest.mark.parametrize("entry", ["app.__main__", "export.__main__"])
def test_onnx_runtime_telemetry_is_off_unless_asked_for(entry):
    """ONNX Runtime 1.29+ sends usage events from Linux unless ORT_DISABLE_TELEMETRY is set: the server and
    the export set it before ONNX Runtime loads, and leave a value the user gave alone."""
    code = f"import os, {entry}; print(os.environ['ORT_DISABLE_TELEMETRY'])"
    env = {k: v for k, v in os.environ.items() if k != "ORT_DISABLE_TELEMETRY"}
    unset = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert unset.stdout.split() == ["1"], unset.stderr
    chosen = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**env, "ORT_DISABLE_TELEMETRY": "0"},
                            capture_output=True, text=True, timeout=60)
    assert chosen.stdout.split()[0] == "0", chosen.stderr


def test_a_variable_that_names_no_setting_is_said_with_the_closest_one():
    """pydantic-settings ignores BERTSERVE_* variables that name no field: a misspelt one would go unnoticed."""
    from app.settings import unknown_variables

    environ = {"BERTSERVE_MAX_BACH_TOKENS": "4096", "BERTSERVE_FROBNICATE": "1", "BERTSERVE_PORT": "8000",
               "BERTSERVE_KERNELS_LIBRARY": "/opt/lib.so", "BERTSERVE_SERVICE_HOST": "10.0.0.1",
               "BERTSERVE_PORT_80_TCP_ADDR": "10.0.0.1", "OTHER_PORT": "1"}
    assert unknown_variables(environ) == [("BERTSERVE_FROBNICATE", None),
                                          ("BERTSERVE_MAX_BACH_TOKENS", "BERTSERVE_MAX_BATCH_TOKENS")]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_every_log_line_has_one_format_with_its_time(tiny_artifact_dir, workers):
    """uvicorn's own lines (start, access log, stop) came without a time, in another format than the app's,
    and a malformed request was logged twice."""
    proc, base = start_server(tiny_artifact_dir, workers=workers, access_log="true")
    try:
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        with socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=10) as bad:
            bad.sendall(b"NOT HTTP\r\n\r\n")
            assert bad.recv(100).startswith(b"HTTP/1.1 400 ")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    lines = [line for line in proc.stdout.read().splitlines() if line.strip()]
    odd = [line for line in lines if not LOG_LINE.match(line)]
    assert not odd and proc.returncode == 0, "\n".join(lines)
    assert any("INFO uvicorn: Application startup complete" in line for line in lines), "\n".join(lines)
    assert any('INFO uvicorn.access: 127.0.0.1:' in line and '"GET /health HTTP/1.1" 200' in line for line in lines)
    # a malformed request is one line, ours (with the client), not uvicorn's too
    assert [line.split(": ", 1)[1][:34] for line in lines if "WARNING" in line] == ["closed a connection from 127.0.0.1"]
