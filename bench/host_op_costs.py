"""What the operations of a one-text /embed request cost on this host's CPU, one by one (µs, best of five
`timeit` repeats), to tell why the same worker costs more on one host than on another: a slower core
slows every row alike, a slow clock source the clock rows, slow system calls the socket row.

The tokenizer is a WordPiece vocabulary trained here on the load texts (as bench/http_worker_load.py's
worker-only artifact), so nothing is read from outside the tree.

  python bench/host_op_costs.py --json /tmp/host.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import mmap
import os
import socket
import struct
import sys
import tempfile
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import orjson  # noqa: E402


def best_us(fn, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def loop_round_trips(number: int) -> dict[str, float]:
    """A task created and awaited, and a future resolved through call_soon, on uvloop (the server's loop)."""
    import uvloop

    async def measure() -> dict[str, float]:
        loop = asyncio.get_running_loop()

        async def nothing() -> None:
            return None

        started = time.perf_counter()
        for _ in range(number):
            await loop.create_task(nothing())
        task_us = (time.perf_counter() - started) / number * 1e6
        started = time.perf_counter()
        for _ in range(number):
            future = loop.create_future()
            loop.call_soon(future.set_result, None)
            await future
        return {"uvloop task created and awaited": task_us,
                "uvloop future resolved by call_soon": (time.perf_counter() - started) / number * 1e6}

    return uvloop.run(measure())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()

    from app.pooling import encode_rows
    from app.responses import json_response
    from app.routes import loads, validate_body
    from app.schemas import EmbedRequest
    from app.tokenization import TextTokenizer
    from bench.http_load import make_texts
    from training.wordpiece import save_tokenizer, train_wordpiece

    texts = make_texts(200)
    with tempfile.TemporaryDirectory() as folder:
        save_tokenizer(train_wordpiece(texts, vocab_size=2000, min_frequency=1), folder)
        tokenizer = TextTokenizer(Path(folder) / "tokenizer.json", 512, 100_000, {})
    for text in texts:  # every word remembered, as in a warm server
        tokenizer.encode_batch([text], True, offsets=False)
    clock = Path("/sys/devices/system/clocksource/clocksource0/current_clocksource")
    figures: dict = {"python": sys.version.split()[0], "numpy": np.__version__, "orjson": orjson.__version__,
                     "clocksource": clock.read_text().strip() if clock.exists() else None}
    for name, value in figures.items():
        print(f"{name:40s} {value}")

    turn = iter(range(10**9))
    body = orjson.dumps({"inputs": [texts[3]]})
    parsed = loads(body)
    vector = np.random.default_rng(0).random((1, 768), dtype=np.float32)
    rows = encode_rows(vector, "float")
    answer = {"model": "m", "data": [{"index": 0, "embedding": rows[0]}], "usage": {"tokens": 20}}
    headers = {"x-tokenize-ms": "0.010", "x-queue-ms": "1.000", "x-inference-ms": "1.000"}
    shared = mmap.mmap(-1, 4096)
    a, b = socket.socketpair()
    four_kb = b"x" * 4096

    def send_and_receive() -> None:
        a.send(four_kb)
        b.recv(65536)

    operations = [
        ("time.perf_counter", time.perf_counter, 200_000),
        ("a system call (getppid)", os.getppid, 200_000),
        ("tokenise one text (by words)",
         lambda: tokenizer.encode_batch([texts[next(turn) % 200]], True, offsets=False), 20_000),
        ("tokenizers' own encode of one text", lambda: tokenizer._ascii_truncating.encode(texts[7]), 5_000),
        ("orjson parse of the body", lambda: loads(body), 20_000),
        ("pydantic EmbedRequest", lambda: validate_body(EmbedRequest, parsed), 20_000),
        ("encode_rows, float", lambda: encode_rows(vector, "float"), 20_000),
        ("orjson of 768 floats", lambda: orjson.dumps(answer, option=orjson.OPT_SERIALIZE_NUMPY), 20_000),
        ("json_response (orjson + Starlette)", lambda: json_response(answer, headers=headers), 20_000),
        ("np.zeros(28)", lambda: np.zeros(28, dtype=np.int64), 200_000),
        ("a float written into a shared map", lambda: struct.pack_into("d", shared, 8, 1.0), 200_000),
        ("4 KB through a socket pair", send_and_receive, 50_000),
    ]
    for name, fn, number in operations:
        figures[name] = round(best_us(fn, number), 3)
        print(f"{name:40s} {figures[name]:8.3f} µs")
    for name, value in loop_round_trips(50_000).items():
        figures[name] = round(value, 3)
        print(f"{name:40s} {figures[name]:8.3f} µs")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
