"""Which CPU cores each process of a multi-process GPU server may run on (`engine_cores`).

An engine process's event loop and the thread that replays CUDA graphs feed the GPU; when the HTTP
workers keep every core busy, those threads wait for a core and find their caches cold. With cores of
their own they do neither (BENCHMARKS.md, "The engine process on cores of its own"). Each process pins
itself as it starts, before it makes any thread, so that every thread it makes inherits its cores."""
from __future__ import annotations

import logging
import os

log = logging.getLogger("app")


def split_cores(allowed: set[int], engines: int, per_engine: int) -> tuple[list[frozenset[int]], frozenset[int]]:
    """(each engine process's cores, the HTTP workers' cores) out of the cores this process may use: the
    engines take the highest-numbered, `per_engine` each; the workers the rest. ValueError when the
    workers would be left without a core."""
    cores = sorted(allowed)
    kept = engines * per_engine
    if kept >= len(cores):
        raise ValueError(f"engine_cores {per_engine} for {engines} engine process(es) keeps {kept} cores, but this "
                         f"process may use only {len(cores)} ({describe(frozenset(cores))}): the HTTP workers need "
                         f"at least one more")
    first = len(cores) - kept
    return ([frozenset(cores[first + i * per_engine: first + (i + 1) * per_engine]) for i in range(engines)],
            frozenset(cores[:first]))


def pin(cores: frozenset[int] | None, who: str) -> None:
    """Run this process (its calling thread, and every thread it makes from now on) on `cores`; None: as it
    was. Where the system refuses, says so and goes on unpinned."""
    if not cores:
        return
    try:
        os.sched_setaffinity(0, cores)
    except OSError as e:
        log.warning("%s could not be pinned to cores %s (%s); it runs on any core", who, describe(cores), e)


def describe(cores: frozenset[int]) -> str:
    """"0-12" or "2,5-7": runs of consecutive cores."""
    runs: list[list[int]] = []
    for core in sorted(cores):
        if runs and core == runs[-1][-1] + 1:
            runs[-1].append(core)
        else:
            runs.append([core])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
