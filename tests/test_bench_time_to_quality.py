"""bench/time_to_quality.py's bookkeeping, on metrics files written here: the training wall-clock without
the evaluations, the interpolated time to an accuracy, and stopping a running arm once it gets there."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from bench.time_to_quality import _wait, curve, has_reached, time_to_reach


def _lines(*events: dict) -> str:
    return "".join(json.dumps(e) + "\n" for e in events)


def _train(step: int, t: float, elapsed: float) -> dict:
    return {"event": "train", "step": step, "time": t, "elapsed_s": elapsed}


def _eval(step: int, t: float, accuracy: float) -> dict:
    return {"event": "eval", "step": step, "time": t, "mlm_accuracy": accuracy, "nsp_accuracy": 0.5,
            "mlm_baseline_accuracy": 0.06}


def test_minutes_leave_out_the_evaluations_and_reaching_is_interpolated(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    # 60 s of training, a 30 s evaluation, 60 s more, another evaluation (its time not yet counted).
    metrics.write_text(_lines(_train(100, 1060, 60), _eval(100, 1090, 0.2),
                              _train(200, 1150, 150), _eval(200, 1155, 0.4)))
    points = curve(metrics)
    assert [p["minutes"] for p in points] == [1.0, 2.0]
    assert time_to_reach(points, 0.3) == 1.5 and time_to_reach(points, 0.5) is None


def test_a_running_arm_is_stopped_once_it_reaches_the_accuracy(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    half_line = '{"event": "eval", "step": 2'
    metrics.write_text(_lines(_train(1, 10, 1), _eval(1, 11, 0.1)) + half_line)
    assert not has_reached(metrics, 0.3)  # the half-written last line is no error
    # An arm that reaches 0.3 at its third evaluation, then would train for a minute more.
    events = [_train(1, 10, 1), _eval(1, 11, 0.1), _train(2, 20, 10), _eval(2, 21, 0.2), _train(3, 30, 19),
              _eval(3, 31, 0.35)]
    script = (f"import time\nwith open({str(metrics)!r}, 'w') as f:\n"
              f"    for line in {[json.dumps(e) for e in events]!r}:\n"
              "        f.write(line + '\\n'); f.flush(); time.sleep(0.3)\n"
              "    time.sleep(60)\n")
    arm = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    started = time.monotonic()
    _wait([arm], time.monotonic() + 50, lambda: has_reached(metrics, 0.3))
    assert arm.returncode is not None and time.monotonic() - started < 20
    assert has_reached(metrics, 0.3) and not has_reached(metrics, 0.4)
