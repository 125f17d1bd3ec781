"""bench/http_load.py serving on the CPU, end to end: a real server with two HTTP workers around an engine
process, loaded by real client processes; each run reports where the server's time went, read from its
own /metrics."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # a server start and a few seconds of load
def test_serving_reports_each_stage_of_a_requests_time(tiny_artifact_dir, tmp_path):
    cmd = [sys.executable, "bench/http_load.py", "serving", "--artifact", str(tiny_artifact_dir), "--device", "cpu",
           "--precision", "fp32", "--workers", "2", "--processes", "1", "--connections", "4", "--duration", "1.5",
           "--engine-batches", "1,8", "--engine-seconds", "0.5", "--latency-requests", "20", "--texts-per-request", "1,8"]
    done = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads((tmp_path / "http_serving.json").read_text())["http"]["workers2"]
    for size in (1, 8):
        run = runs[f"x{size}"]
        assert run["errors"] == 0 and run["requests_per_s"] > 0, run
        assert run["mean_batch_size"] >= 1, run
        # Each stage is a part of the handler's time, and the handler a part of what the client waited.
        assert 0 < run["server_tokenize_ms"] < run["server_request_ms"], run
        assert 0 < run["server_queue_ms"] < run["server_request_ms"], run
        assert 0 < run["server_inference_ms"], run
        assert run["server_request_ms"] < run["mean_ms"] * 1.5, run
        # The engine's threads on batches, in seconds a second: some, on the session (the CPU replays nothing)
        assert 0 < run["engine_busy_session"] <= os.cpu_count() and run["engine_busy_cuda_graph"] == 0, run
        # The whole host's busy cores hold the server's own (sampled over the same window) and fit the host
        cpu = run["server_cpu"]
        assert 0.8 * (cpu["engine_cores"] + cpu["workers_cores"]) <= cpu["host_cores"] <= os.cpu_count() + 0.1, cpu
    assert f"in the server: handler {runs['x1']['server_request_ms']} ms" in done.stderr
    assert f"host {runs['x1']['server_cpu']['host_cores']} of {os.cpu_count()}" in done.stderr
    # The lone short text's split too: each of its requests a batch of one, its link hops within its handler
    lone = runs["c1_short"]["server"]
    assert lone["mean_batch_size"] == 1, lone
    hops = lone["server_link_to_engine_ms"] + lone["server_link_in_engine_ms"] + lone["server_link_from_engine_ms"]
    assert 0 < lone["server_inference_ms"] < lone["server_link_in_engine_ms"] and hops < lone["server_request_ms"], lone
    # The server's means cover the warm-up requests too (a slow first one): compared with the client's mean
    # over the same requests, not with the median of the measured ones (a CI run once saw 1.02 ms against 0.63).
    # 1.2: the window also holds the bench's own /metrics scrape, counted among the requests.
    assert lone["server_request_ms"] < runs["c1_short"]["mean_with_warm_up_ms"] * 1.2, (lone, runs["c1_short"])
    assert f"in the server: handler {lone['server_request_ms']} ms" in done.stderr


@pytest.mark.slow  # a server start and a few seconds of load
@pytest.mark.skipif(not (os.environ.get("WRK") or shutil.which("wrk")), reason="wrk is not installed")
def test_serving_under_wrk_counts_answers_and_latency_from_wrk(tiny_artifact_dir, tmp_path):
    """--clients python,wrk: the same closed loop from wrk (issue 15's load generator) beside the Python
    clients, each run keyed by its client; wrk's own count and histogram give requests/s and latency."""
    cmd = [sys.executable, "bench/http_load.py", "serving", "--artifact", str(tiny_artifact_dir), "--device", "cpu",
           "--precision", "fp32", "--workers", "2", "--processes", "1", "--connections", "4", "--duration", "1.5",
           "--engine-batches", "1", "--engine-seconds", "0.5", "--latency-requests", "20", "--texts-per-request", "1,8",
           "--clients", "python,wrk"]
    done = subprocess.run(cmd, cwd=REPO, env={**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads((tmp_path / "http_serving.json").read_text())["http"]["workers2"]
    for size in (1, 8):
        python, wrk = runs[f"x{size}"], runs[f"x{size}-wrk"]
        assert python["client"] == "python" and wrk["client"] == "wrk"
        assert wrk["errors"] == 0 and wrk["wrk"]["requests"] > 0 and wrk["requests_per_s"] > 0, wrk
        assert wrk["texts_per_s"] == pytest.approx(wrk["requests_per_s"] * size, rel=1e-3)
        assert 0 < wrk["p50_ms"] <= wrk["p99_ms"] <= wrk["max_ms"], wrk
        assert wrk["mean_batch_size"] >= 1 and wrk["server_request_ms"] > 0, wrk
        # wrk's own CPU, from its process over the same window as the server's
        assert 0 < wrk["server_cpu"]["client_cores"] <= wrk["server_cpu"]["host_cores"], wrk["server_cpu"]
        assert 0 < wrk["client_cpu_us_per_request"] and 0 < wrk["client_cpu_share"] <= 1.05, wrk
    assert "wrk, 1 threads x 4 connections" in done.stderr
    # The lone short text from wrk too, one request at a time over one connection
    lone, python_lone = runs["c1_short_wrk"], runs["c1_short"]
    assert lone["client"] == "wrk, one connection" and lone["requests"] > 50, lone
    assert 0 < lone["p50_ms"] <= lone["p99_ms"] and lone["over_engine_ms"] == pytest.approx(
        lone["p50_ms"] - python_lone["p50_ms"] + python_lone["over_engine_ms"], abs=1e-3), (lone, python_lone)
    assert f"wrk, one connection: p50 {lone['p50_ms']} ms" in done.stderr


@pytest.mark.slow  # four server starts and a second of load each
def test_ab_takes_turns_in_alternating_order_and_gives_each_variant_its_settings(tiny_artifact_dir, tmp_path):
    """bench/http_ab.py: every variant's server is loaded once per repeat, in the order A B then B A, with
    the variant's own settings (here a batch cap of 1, which shows in the batches it formed from requests
    of 4 texts); the summary has each variant's median over its runs."""
    out = tmp_path / "ab.json"
    cmd = [sys.executable, "bench/http_ab.py", "--artifact", str(tiny_artifact_dir), "--device", "cpu",
           "--precision", "fp32", "--workers", "2", "--processes", "1", "--connections", "4", "--duration", "1",
           "--clients", "python", "--texts-per-request", "4", "--latency-requests", "10", "--repeats", "2",
           "--variant", "plain", ".", "--variant", "one-row", ".", "max_batch_size=1", "--out", str(out)]
    done = subprocess.run(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    turns = [line.split(" (")[0] for line in done.stderr.splitlines() if line.startswith("== ")]
    assert turns == ["== plain", "== one-row", "== one-row", "== plain"]
    result = json.loads(out.read_text())
    assert [len(result["runs"][name]) for name in ("plain", "one-row")] == [2, 2]
    assert all(run["x4"]["mean_batch_size"] == 1 for run in result["runs"]["one-row"])
    assert all(run["x4"]["mean_batch_size"] > 1 for run in result["runs"]["plain"])  # 4 texts come at once
    for name in ("plain", "one-row"):
        s = result["summary"][name]["x4"]
        low, high = s["requests_per_s_range"]
        assert s["runs"] == 2 and 0 < low <= s["requests_per_s"] <= high, s
        assert result["summary"][name]["c1_short"]["p50_ms"] > 0
    assert "one-row" in done.stdout and "requests/s (median, range)" in done.stdout


def test_ab_refuses_a_variant_that_is_not_a_checkout(tmp_path):
    done = subprocess.run([sys.executable, "bench/http_ab.py", "--artifact", str(tmp_path), "--variant", "a", ".",
                           "--variant", "b", str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (f"--variant b: {tmp_path} is not a checkout of this project "
                                                     f"(no app/__main__.py)")
    done = subprocess.run([sys.executable, "bench/http_ab.py", "--artifact", str(tmp_path), "--variant", "a", ".",
                           "--variant", "b", ".", f"model_dir={tmp_path}"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (f"--variant b: model_dir {tmp_path} is not an artifact "
                                                     f"(no manifest.json)")


@pytest.mark.slow  # a server start
def test_a_model_dir_setting_serves_that_artifact(tiny_artifact_dir, tmp_path):
    """http_load.serve with model_dir=PATH (an http_ab variant's own artifact) serves PATH, not the artifact
    it was given."""
    import httpx

    from bench.http_load import serve

    other = shutil.copytree(tiny_artifact_dir, tmp_path / "other")
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["model_name"] = "the-other-one"
    (other / "manifest.json").write_text(json.dumps(manifest))
    with serve(tiny_artifact_dir, device="cpu", model_dir=other) as url:
        assert httpx.get(f"{url}/info").json()["model"] == "the-other-one"


@pytest.mark.slow  # three worker processes, a stand-in engine and a few seconds of load
def test_worker_load_measures_a_worker_beside_the_floor_of_http_and_json(tmp_path):
    """bench/http_worker_load.py --floor: beside this checkout's worker, a worker that is only uvicorn and a
    plain ASGI app answering JSON, loaded at once on one core: both answer every request, in both formats,
    and the floor, a strict part of a worker's work, costs less CPU a request."""
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, "bench/http_worker_load.py", "--texts-per-request", "1,4", "--formats",
                           "float,base64", "--rounds", "1", "--warm-up", "0.5", "--duration", "1", "--together",
                           "--floor", "--connections", "4", "--json", str(out)],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(r["app_root"], r["texts_per_request"], r["encoding_format"]): r for r in json.loads(out.read_text())}
    assert {root for root, _, _ in rows} == {str(REPO), "floor"}
    for (root, texts, fmt), row in rows.items():
        assert row["errors"] == 0 and row["requests_per_s"] > 0 and row["cpu_us_per_request"] > 0, row
        if root == "floor":
            assert row["cpu_us_per_request"] < rows[str(REPO), texts, fmt]["cpu_us_per_request"], (row, rows)
