"""Histograms (and a gauge) that the HTTP workers update on every request, summed over every process of the
server.

In prometheus_client's multiprocess mode each observation writes two memory-mapped values, each under a
lock (1.65 µs on this project's VM against 0.57 in a process's own registry); a one-text request made about
ten such writes, 14% of a worker's CPU (BENCHMARKS.md). Here each process keeps a family's bucket counts
and sums as doubles in one memory-mapped file of its own, written in place by index (no lock: a family is
observed from its process's event loop only), and a collector, prometheus_client's public extension point,
sums every process's file at scrape time, as its multiprocess collector sums its own files. Files of
processes that have exited keep counting, as prometheus_client's histograms do; a gauge counts only while
its process lives (prometheus_client's "livesum": `remove_gauges` removes its files once it has ended).
"""
from __future__ import annotations

import mmap
import os
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

SUFFIX = ".shared"  # prometheus_client's multiprocess collector reads only its own *.db files
GAUGE_PREFIX = "gauge-"  # a gauge's files, found by it when their process has ended


def _mapped(directory: Path | None, name: str, count: int) -> mmap.mmap:
    """`count` doubles in this process's file for `name` (zeros when new), or in anonymous memory."""
    nbytes = 8 * count
    if directory is None:
        return mmap.mmap(-1, nbytes)
    path = directory / f"{name}_{os.getpid()}{SUFFIX}"
    with open(path, "a+b") as f:
        if os.fstat(f.fileno()).st_size < nbytes:
            f.truncate(nbytes)
        return mmap.mmap(f.fileno(), nbytes)


def _summed(directory: Path | None, name: str, own: mmap.mmap, count: int) -> np.ndarray:
    """Every process's doubles for `name` summed (only this process's without a directory)."""
    if directory is None:
        return np.frombuffer(own, np.float64).copy()
    summed = np.zeros(count)
    for path in directory.glob(f"{name}_*{SUFFIX}"):
        family, _, pid = path.stem.rpartition("_")
        if family == name and pid.isdigit():  # not another family whose name starts with this one's
            data = np.fromfile(path, np.float64, count=count)
            summed[:len(data)] += data
    return summed


class SharedGauge:
    """A gauge of one value, summed over the live processes."""

    def __init__(self, directory: Path | None, name: str, documentation: str):
        self.name, self.documentation, self._directory = name, documentation, directory
        self._file = GAUGE_PREFIX + name
        self._map = _mapped(directory, self._file, 1)
        self._values = memoryview(self._map).cast("d")

    def inc(self) -> None:
        self._values[0] += 1.0

    def dec(self) -> None:
        self._values[0] -= 1.0

    def collect(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(self.name, self.documentation, float(_summed(self._directory, self._file, self._map,
                                                                               1)[0]))


class SharedHistogram:
    """One histogram family: a series per label values given up front (so that every process lays out its
    file alike), each as its buckets' counts (not cumulative; the last is +Inf) and then its sum."""

    def __init__(self, directory: Path | None, name: str, documentation: str, buckets: Sequence[float],
                 labelnames: Sequence[str] = (), series: Sequence[tuple[str, ...]] = ((),), unused_shown: bool = True):
        self.name, self.documentation, self.unused_shown = name, documentation, unused_shown
        self.bounds = tuple(float(b) for b in buckets)
        self.labelnames, self.series = tuple(labelnames), tuple(series)
        self._directory = directory
        self._width = len(self.bounds) + 2  # the buckets, +Inf, the sum
        self._map = _mapped(directory, name, self._width * len(self.series))
        self._values = memoryview(self._map).cast("d")

    def observer(self, *labelvalues: str) -> Callable[[float], None]:
        """The function that observes one value into the series of these label values."""
        base = self._width * self.series.index(tuple(labelvalues))
        total, values, bounds = base + self._width - 1, self._values, self.bounds

        def observe(value: float) -> None:
            values[base + bisect_left(bounds, value)] += 1.0
            values[total] += value
        return observe

    def collect(self) -> HistogramMetricFamily:
        """Every process's counts summed (only this process's without a directory)."""
        summed = _summed(self._directory, self.name, self._map, self._width * len(self.series))
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        les = [floatToGoString(b) for b in self.bounds] + ["+Inf"]
        for i, labelvalues in enumerate(self.series):
            row = summed[i * self._width:(i + 1) * self._width]
            counts = np.cumsum(row[:-1])
            if not self.unused_shown and counts[-1] == 0:
                continue
            family.add_metric(list(labelvalues), list(zip(les, counts.tolist())), float(row[-1]))
        return family


def remove_gauges(directory: Path, pid: int) -> None:
    """The gauges of process `pid`, which has ended, stop counting."""
    for path in directory.glob(f"{GAUGE_PREFIX}*_{pid}{SUFFIX}"):
        path.unlink(missing_ok=True)


class SharedMetrics:
    """A collector (register it in the registry that exposes the metrics) of the families made here."""

    def __init__(self, directory: Path | None):
        self._directory = directory
        self._families: list[SharedGauge | SharedHistogram] = []

    def gauge(self, name: str, documentation: str) -> SharedGauge:
        gauge = SharedGauge(self._directory, name, documentation)
        self._families.append(gauge)
        return gauge

    def histogram(self, name: str, documentation: str, buckets: Sequence[float], labelnames: Sequence[str] = (),
                  series: Sequence[tuple[str, ...]] = ((),), unused_shown: bool = True) -> SharedHistogram:
        """`unused_shown` False: a series appears once observed (as a prometheus_client child made on first use)."""
        family = SharedHistogram(self._directory, name, documentation, buckets, labelnames, series, unused_shown)
        self._families.append(family)
        return family

    def collect(self) -> Iterable[HistogramMetricFamily | GaugeMetricFamily]:
        for family in self._families:
            yield family.collect()
