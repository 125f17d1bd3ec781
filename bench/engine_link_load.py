"""CPU cost of the engine process of a multi-process server, per sequence, without a GPU.

On a GPU the engine process (app/multiprocess/engine_process.py: the link, the batcher, collation, answers) must keep up
with the GPU (in session 2 it capped HTTP throughput), and the GPU is not needed to measure what it
costs. This runs the real `serve_workers` and DynamicBatcher over a stand-in engine that returns zero
vectors after sleeping as long as the GPU would (--gpu-us-per-token; the GIL is released, as ORT
releases it), pinned to one core, and loads it from client processes that use the real EngineClient on
pre-tokenised sequences (pinned to the other cores).
Prints sequences/s and the engine process's CPU µs per sequence (its ceiling is 1e6 / that).

  python bench/engine_link_load.py --texts-per-request 1,16,64 --duration 5
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import sys
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.http_load import _fast_loop  # noqa: E402

HIDDEN = 768
OUTPUTS = frozenset({"cls_embedding"})


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _engine(socket_path: str, core: int, gpu_us_per_token: float, batches_at_once: int) -> None:
    os.sched_setaffinity(0, {core})
    _fast_loop()
    from app.batcher import DynamicBatcher
    from app.backend import EngineInfo
    from app.multiprocess.engine_link import serve_workers

    gpu = threading.Lock()  # one GPU: batches in flight overlap their host work, not their kernels

    def run(batch):
        with gpu:
            time.sleep(gpu_us_per_token * 1e-6 * int(batch.attention_mask.sum()))
        return {name: np.zeros((len(batch.input_ids), HIDDEN), np.float32) for name in batch.outputs}

    async def serve():
        batcher = DynamicBatcher(run, pad_id=0, max_batch_tokens=16384, max_batch_size=256, max_wait_ms=0,
                                 max_queued=1 << 20, inference_workers=batches_at_once, packed=True)
        batcher.start()
        info = EngineInfo("cuda", "fp16", "stand-in", None, batches_at_once, 16384, os.getpid())
        server = await asyncio.get_running_loop().create_unix_server(serve_workers(batcher, info), path=socket_path)
        async with server:
            await asyncio.Event().wait()

    asyncio.run(serve())


def _client(socket_path: str, cores: set[int], texts: int, in_flight: int, duration: float, seed: int, queue,
            go) -> None:
    os.sched_setaffinity(0, cores)
    _fast_loop()
    from app.batcher import Sequences
    from app.multiprocess.engine_link import EngineClient

    rng = np.random.default_rng(seed)
    requests = []
    for _ in range(64):  # lengths 10-42: mean 26 tokens, as the GPU HTTP benchmark's texts
        lengths = rng.integers(10, 43, texts)
        requests.append(Sequences(rng.integers(1000, 30000, lengths.sum()), np.zeros(lengths.sum(), np.int64),
                                  lengths))

    async def main():
        client = EngineClient(socket_path)
        await client.connect()
        queue.put("ready")
        await asyncio.to_thread(go.wait)
        done, stop_at = 0, time.perf_counter() + duration

        async def one_stream(k: int):
            nonlocal done
            i = k
            while time.perf_counter() < stop_at:
                result = await client.submit_group(requests[i % len(requests)], OUTPUTS)
                assert result.outputs["cls_embedding"].shape == (texts, HIDDEN)
                done += texts
                i += 1

        await asyncio.gather(*(one_stream(k) for k in range(in_flight)))
        await client.stop()
        return done

    queue.put(asyncio.run(main()))


def measure(texts: int, clients: int, in_flight: int, duration: float, gpu_us_per_token: float,
            batches_at_once: int, profile: Path | None = None) -> dict:
    ctx = multiprocessing.get_context("spawn")
    cores = sorted(os.sched_getaffinity(0))
    client_cores = set(cores[1:]) or {cores[0]}
    with tempfile.TemporaryDirectory(prefix="link-load-") as folder:
        socket_path = os.path.join(folder, "engine.sock")
        engine = ctx.Process(target=_engine, args=(socket_path, cores[0], gpu_us_per_token, batches_at_once),
                             daemon=True)
        engine.start()
        while not os.path.exists(socket_path):
            time.sleep(0.05)
        results, go = ctx.Queue(), ctx.Event()
        procs = [ctx.Process(target=_client, args=(socket_path, client_cores, texts, in_flight, duration, k, results,
                                                   go))
                 for k in range(clients)]
        for p in procs:
            p.start()
        for _ in procs:
            assert results.get(timeout=120) == "ready"
        cpu0, t0 = _cpu_seconds(engine.pid), time.perf_counter()
        go.set()
        if profile:  # py-spy samples the engine process while the clients run (needs `pip install py-spy`)
            spy = subprocess.Popen(["py-spy", "record", "--pid", str(engine.pid), "--duration", str(int(duration)),
                                    "--rate", "500", "--format", "raw", "--output", str(profile), "--gil"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        total = sum(results.get(timeout=duration + 120) for _ in procs)
        wall, cpu = time.perf_counter() - t0, _cpu_seconds(engine.pid) - cpu0
        if profile:
            spy.wait()
        for p in procs:
            p.join()
        engine.kill()
        engine.join()
    return {"texts_per_request": texts, "clients": clients, "in_flight": in_flight, "sequences": total,
            "sequences_per_s": round(total / wall), "engine_cpu_us_per_sequence": round(cpu / total * 1e6, 2),
            "engine_cpu_busy": round(cpu / wall, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts-per-request", default="1,16,64")
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument("--in-flight", type=int, default=16, help="requests each client keeps in flight")
    parser.add_argument("--duration", type=float, default=5.0)
    parser.add_argument("--gpu-us-per-token", type=float, default=0.0,
                        help="stand-in inference time; 0.55 is an H200 on BERT-base fp16 at 26-token texts")
    parser.add_argument("--batches-at-once", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--profile", type=Path, help="py-spy stacks of the engine process, one file per request "
                        "size: PROFILE.<texts>.txt (collapsed stacks)")
    args = parser.parse_args()
    rows = []
    for texts in map(int, args.texts_per_request.split(",")):
        profile = args.profile and args.profile.with_suffix(f".{texts}.txt")
        row = measure(texts, args.clients, args.in_flight, args.duration, args.gpu_us_per_token, args.batches_at_once,
                      profile)
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
