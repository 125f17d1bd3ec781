"""app/shared_metrics.py against prometheus_client itself: the same observations, made in several real
processes, expose the same text as one prometheus_client histogram given them all; a gauge counts while
its process lives."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from app.shared_metrics import GAUGE_PREFIX, SUFFIX, SharedMetrics

BUCKETS = (.001, .01, .1, 1)
SERIES = [("/embed",), ("other",)]
ROOT = Path(__file__).resolve().parents[1]


def _in_a_process(directory: Path, values: list[tuple[str, float]], gauge_incs: int, exits_cleanly: bool) -> None:
    script = textwrap.dedent(f"""
        import os
        from pathlib import Path
        from app.shared_metrics import SharedMetrics, remove_gauges
        shared = SharedMetrics(Path({str(directory)!r}))
        family = shared.histogram("t_seconds", "doc", {BUCKETS!r}, ["endpoint"], {SERIES!r})
        for endpoint, value in {values!r}:
            family.observer(endpoint)(value)
        gauge = shared.gauge("t_inflight", "doc")
        for _ in range({gauge_incs}):
            gauge.inc()
        if {exits_cleanly}:
            remove_gauges(Path({str(directory)!r}), os.getpid())
    """)
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT, timeout=60)


def _family_samples(text: bytes, name: str) -> list[tuple[str, float]]:
    """The family's samples in order, without *_created (the server turns those off)."""
    return [(line.rsplit(" ", 1)[0], float(line.rsplit(" ", 1)[1])) for line in text.decode().splitlines()
            if (sample := line.split("{")[0].split(" ")[0]).startswith(name) and not sample.endswith("_created")]


def test_histograms_from_several_processes_sum_to_prometheus_clients_own(tmp_path):
    mine = [("/embed", 0.0005), ("/embed", 0.001), ("/embed", 0.05), ("other", 3.0)]
    theirs = [("/embed", 0.01), ("/embed", 0.5), ("other", 0.0)]
    _in_a_process(tmp_path, theirs, gauge_incs=2, exits_cleanly=True)  # its gauge no longer counts
    _in_a_process(tmp_path, [("/embed", 2.0)], gauge_incs=3, exits_cleanly=False)  # still counted (livesum)
    shared = SharedMetrics(tmp_path)
    family = shared.histogram("t_seconds", "doc", BUCKETS, ["endpoint"], SERIES)
    for endpoint, value in mine:
        family.observer(endpoint)(value)
    gauge = shared.gauge("t_inflight", "doc")
    gauge.inc()
    gauge.inc()
    gauge.dec()
    exposed = CollectorRegistry()
    exposed.register(shared)

    oracle = CollectorRegistry()
    reference = Histogram("t_seconds", "doc", ["endpoint"], buckets=BUCKETS, registry=oracle)
    for endpoint, value in mine + theirs + [("/embed", 2.0)]:
        reference.labels(endpoint).observe(value)
    text = generate_latest(exposed)
    got, want = _family_samples(text, "t_seconds"), _family_samples(generate_latest(oracle), "t_seconds")
    assert [name for name, _ in got] == [name for name, _ in want]
    assert [value for _, value in got] == pytest.approx([value for _, value in want], rel=1e-12)  # sums' order
    assert "t_inflight 4.0" in text.decode().splitlines()  # 1 here + 3 in the process that did not exit cleanly
    assert len(list(tmp_path.glob(f"{GAUGE_PREFIX}t_inflight_*{SUFFIX}"))) == 2
    assert len(list(tmp_path.glob(f"t_seconds_*{SUFFIX}"))) == 3  # an ended process's histogram still counts


def test_without_a_directory_a_process_counts_only_its_own(tmp_path):
    _in_a_process(tmp_path, [("/embed", 0.5)], gauge_incs=1, exits_cleanly=False)
    shared = SharedMetrics(None)
    family = shared.histogram("t_seconds", "doc", BUCKETS, ["endpoint"], SERIES)
    family.observer("other")(0.002)
    text = generate_latest_of(shared).decode()
    assert 't_seconds_count{endpoint="other"} 1.0' in text and 't_seconds_count{endpoint="/embed"} 0.0' in text
    used_only = SharedMetrics(None)
    used_only.histogram("u_seconds", "doc", BUCKETS, ["endpoint"], SERIES, unused_shown=False).observer("other")(3.0)
    text = generate_latest_of(used_only).decode()
    assert 'u_seconds_count{endpoint="other"} 1.0' in text and 'endpoint="/embed"' not in text


def generate_latest_of(collector) -> bytes:
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry)


def test_a_killed_process_stops_counting_in_gauges_but_not_in_histograms(tmp_path, monkeypatch):
    """metrics.process_ended (the HTTP workers' supervisor calls it for a worker that died): what the dead
    process had in flight, in any gauge, no longer counts; what it observed still does."""
    from app.metrics import process_ended

    script = textwrap.dedent(f"""
        import os
        from pathlib import Path
        from app.shared_metrics import SharedMetrics
        shared = SharedMetrics(Path({str(tmp_path)!r}))
        shared.gauge("bertserve_inflight_requests", "doc").inc()
        shared.gauge("t_busy", "doc").inc()
        shared.histogram("t_seconds", "doc", {BUCKETS!r}).observer()(0.5)
        print(os.getpid())  # and dies without Metrics.process_exited
    """)
    pid = int(subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT, timeout=60, capture_output=True,
                             text=True).stdout)
    shared = SharedMetrics(tmp_path)
    shared.gauge("bertserve_inflight_requests", "doc").inc()
    shared.gauge("t_busy", "doc")
    shared.histogram("t_seconds", "doc", BUCKETS)
    text = generate_latest_of(shared).decode().splitlines()
    assert "bertserve_inflight_requests 2.0" in text and "t_busy 1.0" in text
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    process_ended(pid)
    text = generate_latest_of(shared).decode().splitlines()
    assert "bertserve_inflight_requests 1.0" in text and "t_busy 0.0" in text and "t_seconds_count 1.0" in text


def test_a_family_sums_only_its_own_files_where_another_name_starts_with_its_name(tmp_path):
    """Files are found by family name and process id: `t`'s sum must not take in `t_x`'s files."""
    shared = SharedMetrics(tmp_path)
    short, longer = shared.histogram("t", "doc", BUCKETS), shared.histogram("t_x", "doc", BUCKETS)
    short.observer()(0.5)
    for _ in range(3):
        longer.observer()(0.5)
    text = generate_latest_of(shared).decode().splitlines()
    assert "t_count 1.0" in text and "t_x_count 3.0" in text
