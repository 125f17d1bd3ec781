"""Start-up cost of the integrity check: Manifest.verify over an artifact's files against `python -m app`
from launch to /ready (which includes that check).

    python bench/make_base_model.py /tmp/base && python -m export --model /tmp/base/model --out /tmp/base-art
    python bench/startup_integrity.py /tmp/base-art
"""
from __future__ import annotations

import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from a checkout

from artifact.manifest import read_manifest  # noqa: E402


def seconds_to_ready(artifact: str, port: int) -> float:
    started = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "app", "--model-dir", artifact, "--port", str(port)], cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1).status == 200:
                    return time.perf_counter() - started
            except OSError:
                if server.poll() is not None:
                    raise SystemExit(f"the server exited with {server.returncode}")
                time.sleep(0.05)
    finally:
        server.terminate()
        server.wait()


def main(artifact: str, runs: int = 4) -> None:
    verify, ready = [], []
    for port in range(8801, 8801 + runs):
        manifest = read_manifest(artifact)
        started = time.perf_counter()
        manifest.verify(artifact, manifest.files_sha256)
        verify.append(time.perf_counter() - started)
        ready.append(seconds_to_ready(artifact, port))
    size = sum((Path(artifact) / name).stat().st_size for name in read_manifest(artifact).files_sha256) / 1e6
    print(f"verify ({size:.0f} MB): median {statistics.median(verify):.2f} s {[round(x, 2) for x in verify]}")
    print(f"python -m app to /ready: median {statistics.median(ready):.2f} s {[round(x, 2) for x in ready]}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/base-art")
