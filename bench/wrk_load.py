"""Closed-loop HTTP load from `wrk` (C, one epoll loop per thread), as issue 15's figures were measured.

`wrk` costs a few µs of CPU per request where the Python clients of bench/http_load.py cost about 50, and
it answers each connection as soon as its bytes arrive: what a request waits for is then the server's,
not the load generator's event loop working through a burst of answers. Each wrk thread reads the
request bodies from a file (one JSON body a line), starts at its own offset and cycles through them.

Needs `wrk` on PATH (Debian/Ubuntu: `apt-get install wrk`), or its path in $WRK.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_SCRIPT = r"""
local bodies_file = "%(bodies)s"
local counter = 0
local requests = {}
local thread_id = 0
local threads = {}

function setup(thread)
  thread:set("id", thread_id)
  thread_id = thread_id + 1
end

function init(args)
  local headers = {["Content-Type"] = "application/json"}
  for line in io.lines(bodies_file) do
    requests[#requests + 1] = wrk.format("POST", "%(path)s", headers, line)
  end
  counter = (id * 7919) %% #requests
end

function request()
  counter = counter %% #requests + 1
  return requests[counter]
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRK_RESULT {"requests": %%d, "duration_us": %%d, "bytes": %%d, "connect_errors": %%d, ' ..
    '"read_errors": %%d, "write_errors": %%d, "status_errors": %%d, "timeouts": %%d, ' ..
    '"p50_us": %%d, "p90_us": %%d, "p99_us": %%d, "max_us": %%d, "mean_us": %%.1f}\n',
    summary.requests, summary.duration, summary.bytes, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max, latency.mean))
end
"""


def wrk_binary() -> str:
    found = os.environ.get("WRK") or shutil.which("wrk")
    if not found:
        raise SystemExit("wrk not found: install it (apt-get install wrk) or set WRK to its path")
    return found


@dataclass
class WrkRun:
    """A wrk process under way, and when it started."""
    process: subprocess.Popen
    folder: Path
    started: float  # perf_counter() at its start


def start_wrk(url: str, bodies: list[bytes], threads: int, connections: int, duration_s: float,
              path: str = "/embed") -> WrkRun:
    """Start wrk in the background (so that the caller can sample the server meanwhile); finish with
    `wrk_result`. Connections are spread over the threads by wrk (at least one each); wrk takes whole
    seconds, and its rates divide by the time it measured."""
    folder = Path(tempfile.mkdtemp(prefix="wrk-"))
    (folder / "bodies.jsonl").write_bytes(b"\n".join(bodies) + b"\n")
    script = folder / "load.lua"
    script.write_text(_SCRIPT % {"bodies": folder / "bodies.jsonl", "path": path})
    command = [wrk_binary(), "-t", str(threads), "-c", str(max(connections, threads)),
               "-d", f"{max(1, round(duration_s))}s", "--timeout", "30s", "-s", str(script), url]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return WrkRun(process, folder, time.perf_counter())


def wrk_result(run: WrkRun, per_request: int, connections: int) -> dict:
    """The keys of bench/http_load.py's multiprocess_load, from wrk's own count and latency histogram, and
    the cores wrk kept busy over its run, start-up included (`client_cores`: from its resource usage when
    it ends, to the microsecond, where /proc's 10 ms ticks cannot see a light load's client)."""
    process = run.process
    output = process.stdout.read()  # to its end: wrk has exited (or closed its output)
    process.stdout.close()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here, for its resource usage
    client_cores = (usage.ru_utime + usage.ru_stime) / (time.perf_counter() - run.started)
    shutil.rmtree(run.folder, ignore_errors=True)
    line = next((l for l in output.splitlines() if l.startswith("WRK_RESULT ")), None)
    if process.returncode != 0 or line is None:
        raise RuntimeError(f"wrk failed (exit {process.returncode}):\n{output[-2000:]}")
    r = json.loads(line.removeprefix("WRK_RESULT "))
    seconds = r["duration_us"] / 1e6
    errors = r["status_errors"] + r["timeouts"] + r["read_errors"] + r["write_errors"] + r["connect_errors"]
    answered = r["requests"] - r["status_errors"]  # a refused request (429) is not throughput
    return {"client": "wrk", "clients": connections, "texts_per_request": per_request,
            "requests_per_s": round(answered / seconds, 1), "texts_per_s": round(answered * per_request / seconds, 1),
            "p50_ms": round(r["p50_us"] / 1e3, 2), "p90_ms": round(r["p90_us"] / 1e3, 2),
            "p99_ms": round(r["p99_us"] / 1e3, 2), "max_ms": round(r["max_us"] / 1e3, 2),
            "errors": errors, "client_cores": round(client_cores, 4), "wrk": r}
