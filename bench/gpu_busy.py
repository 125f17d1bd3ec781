"""How much of a run the GPU spent running kernels: nvidia-smi's utilization.gpu ("percent of time over
the past sample period during which one or more kernels was executing") sampled every 100 ms.

A coarse figure (the driver's own sample period is 1/6 to 1 s), but it tells a GPU-bound load (near 100)
from one bound by the host (well below), which the server's own metrics cannot.

    with gpu_busy(device_id=0) as busy:
        ...load...
    busy["gpu_busy_percent"]   # mean of the samples; absent when nvidia-smi is not there
"""
from __future__ import annotations

import contextlib
import shutil
import statistics
import subprocess
from collections.abc import Iterator


@contextlib.contextmanager
def gpu_busy(device_id: int = 0, period_ms: int = 100) -> Iterator[dict]:
    figures: dict = {}
    if shutil.which("nvidia-smi") is None:
        yield figures
        return
    sampler = subprocess.Popen(["nvidia-smi", "-i", str(device_id), "--query-gpu=utilization.gpu",
                                "--format=csv,noheader,nounits", "-lms", str(period_ms)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        yield figures
    finally:
        sampler.terminate()
        out, _ = sampler.communicate(timeout=10)
        samples = [float(line) for line in out.split() if line.replace(".", "", 1).isdigit()]
        if len(samples) > 2:  # the first and last straddle the run's edges
            figures["gpu_busy_percent"] = round(statistics.mean(samples[1:-1]), 1)
