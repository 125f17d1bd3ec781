"""app/replay_turns.py: lanes replay one at a time, and a lane takes its next batch when the running
replay is due to end, less the time a lane needs to get a batch ready (real threads, real sleeps)."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from app.replay_turns import ReplayTurns


def test_one_replay_at_a_time():
    turns, spans = ReplayTurns(), []

    def replay(bucket: str) -> None:
        with turns.turn(bucket):
            began = time.perf_counter()
            time.sleep(0.05)
            spans.append((began, time.perf_counter()))

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(replay, ["a", "b", "a", "b", "a", "b"]))
    spans.sort()
    assert len(spans) == 6
    assert all(end <= next_begin for (_, end), (next_begin, _) in zip(spans, spans[1:]))
    assert turns.expected_s("a") == pytest.approx(0.05, abs=0.03) and turns.expected_s("c") is None


def test_a_lane_takes_its_batch_as_the_running_replay_nears_its_end():
    turns = ReplayTurns()
    with turns.turn("bucket"):  # measured once: 0.3 s
        time.sleep(0.3)
    assert turns.expected_s("bucket") == pytest.approx(0.3, abs=0.05)
    assert turns.ready_s == 0.0
    started = threading.Event()
    ended = []

    def replay() -> None:
        with turns.turn("bucket"):
            started.set()
            time.sleep(0.3)
        ended.append(time.perf_counter())

    other = threading.Thread(target=replay)
    other.start()
    started.wait(5)
    began = time.perf_counter()
    turns.wait_to_take()  # the other lane's replay is due in 0.3 s
    woke = time.perf_counter()
    other.join()
    assert 0.2 < woke - began and woke < ended[0] + 0.01  # near its end, before it (less the margin)
    # No replay running: at once
    began = time.perf_counter()
    turns.wait_to_take()
    assert time.perf_counter() - began < 0.01
    turns.not_taken()


def test_the_time_to_get_ready_is_measured_from_the_take_to_the_turn():
    turns = ReplayTurns()
    turns.wait_to_take()
    time.sleep(0.1)  # take, pack, copy
    with turns.turn("bucket"):
        pass
    assert turns.ready_s == pytest.approx(0.1 * 0.1, rel=0.5)  # a running mean from zero, weight 0.1
    measured = turns.ready_s
    turns.wait_to_take()
    turns.not_taken()  # nothing was there to take
    time.sleep(0.1)
    with turns.turn("bucket"):  # a batch handed over by the loop: no take on this thread to time
        pass
    assert turns.ready_s == measured


def test_a_lane_that_needs_longer_to_get_ready_takes_its_batch_earlier():
    turns = ReplayTurns()
    with turns.turn("bucket"):
        time.sleep(0.3)
    for _ in range(20):  # 50 ms from take to turn, each time
        turns.wait_to_take()
        time.sleep(0.05)
        with turns.turn("other"):
            pass
    ready = turns.ready_s
    assert 0.04 < ready < 0.055  # 0.05 x (1 - 0.9^20), plus the sleeps' overshoot
    measured, started = turns.expected_s("bucket"), threading.Event()

    def replay() -> None:
        with turns.turn("bucket"):
            started.set()
            time.sleep(measured + 0.1)

    other = threading.Thread(target=replay)
    other.start()
    started.wait(5)
    began = time.perf_counter()
    turns.wait_to_take()
    waited = time.perf_counter() - began
    other.join()
    assert measured - ready - 0.02 < waited < measured - ready + 0.02, (measured, ready, waited)
