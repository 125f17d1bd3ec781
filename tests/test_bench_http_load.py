"""bench/http_load.py serving on the CPU, end to end: a real server with two HTTP workers around an engine
process, loaded by real client processes; each run reports where the server's time went, read from its
own /metrics."""
from __future__ import annotations

import json
import os
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
    assert f"in the server: handler {runs['x1']['server_request_ms']} ms" in done.stderr
