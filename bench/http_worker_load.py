"""CPU cost of ONE HTTP worker process of a multi-process server, per request and per text, without a GPU.

With `--workers N` on a GPU the engine process keeps up (bench/engine_link_load.py); what limits HTTP
throughput is the CPU each worker spends per request. This runs the real worker (uvicorn, the FastAPI
app, the tokenizer, EngineClient, prometheus multiprocess metrics) pinned to one core, against a stand-in
engine process (the real `serve_workers` and DynamicBatcher over a function that answers at once with
random vectors), loaded over keep-alive connections from this process on the other core. The worker's
CPU time comes from /proc/PID/stat over a fixed window, divided by the requests answered in it.

The worker reads only manifest.json and tokenizer.json, and never checks the vectors' width: by default
it serves a worker-only artifact made here (a WordPiece vocabulary trained on the load texts, ~26 tokens
a text, as bench/make_base_model.py's; a manifest of --hidden width; an empty graph file).

--app-roots A,B runs one worker per source tree (e.g. a copy of app/ before a change, and this checkout),
each round measuring every tree in turn: an A/B on the same noisy cores. Medians over --rounds. With
--together every tree's worker is loaded at once, sharing the one core, so that the host's speed swings
hit them alike: round-to-round ratios then agree within a few percent, where in turn they spread by ±20%.

  python bench/http_worker_load.py --texts-per-request 1,16,64 --formats float,base64 --rounds 5
  python bench/http_worker_load.py --app-roots /tmp/before,. --rounds 7
  python bench/http_worker_load.py --texts-per-request 64 --profile /tmp/worker   # py-spy: /tmp/worker.64.float.txt
  python bench/http_worker_load.py --texts-per-request 1,16 --together --floor   # against uvicorn + JSON alone
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from app.multiprocess.worker_files import copy_worker_files, worker_files_dir  # noqa: E402
from bench.engine_link_load import _cpu_seconds  # noqa: E402
from bench.http_load import _fast_loop, make_texts, open_connections  # noqa: E402

# The worker as `python -m app --workers N` runs each of its processes (uvicorn, the worker app). Trees from
# before app/uvicorn_server.py (--app-roots may name one) ran the factory under uvicorn.run.
_WORKER = """
import os, sys, uvicorn
port = int(sys.argv[1])
if not os.path.exists('app/uvicorn_server.py'):
    from app.__main__ import _fast_protocols
    uvicorn.run('app.multiprocess.http_workers:create_worker_app', factory=True, host='127.0.0.1', port=port,
                log_level='warning', access_log=False, timeout_graceful_shutdown=10, **_fast_protocols())
else:
    from app.uvicorn_server import uvicorn_options
    from app.multiprocess.http_workers import create_worker_app
    front = create_worker_app()
    uvicorn.run(front, host='127.0.0.1', port=port, **{**uvicorn_options(front.state.settings),
                                                       'log_level': 'warning', 'access_log': False})
"""


# --floor: what a worker costs before any of this project's code runs. uvicorn with the same fast loop and
# parser, and a plain ASGI app that reads the JSON body and answers as many stored vectors as it has texts,
# in the asked format: the HTTP, the JSON in and the JSON out, and nothing else.
_FLOOR = """
import base64, sys
import numpy as np, orjson, uvicorn
vectors = np.random.default_rng(0).random((512, int(sys.argv[2])), dtype=np.float32)

async def app(scope, receive, send):
    if scope['type'] != 'http':
        return
    body, more = b'', True
    while more:
        message = await receive()
        body, more = body + message.get('body', b''), message.get('more_body', False)
    answer = b'{}'
    if scope['method'] == 'POST':
        request = orjson.loads(body)
        inputs = request['inputs'] if 'inputs' in request else request['input']  # /embed's or OpenAI's
        n = len(inputs) if isinstance(inputs, list) else 1
        rows = ([base64.b64encode(v.tobytes()).decode() for v in vectors[:n]]
                if request.get('encoding_format') == 'base64' else list(vectors[:n]))
        answer = orjson.dumps({'model': 'floor', 'data': [{'index': i, 'embedding': e} for i, e in enumerate(rows)],
                               'usage': {'tokens': 0}}, option=orjson.OPT_SERIALIZE_NUMPY)
    await send({'type': 'http.response.start', 'status': 200,
                'headers': [(b'content-type', b'application/json'), (b'content-length', str(len(answer)).encode())]})
    await send({'type': 'http.response.body', 'body': answer})

uvicorn.run(app, host='127.0.0.1', port=int(sys.argv[1]), loop='uvloop', http='httptools', log_level='warning',
            access_log=False)
"""
FLOOR = Path("floor")  # the --floor worker's place among the --app-roots


def make_worker_artifact(out: Path, hidden: int, texts: list[str]) -> Path:
    """What a worker reads of an artifact: tokenizer.json and manifest.json (the graph file is empty)."""
    from artifact.manifest import GraphInfo, Manifest, sha256_file
    from training.wordpiece import SPECIAL_TOKENS, save_tokenizer, train_wordpiece

    tokenizer = train_wordpiece(texts, vocab_size=2000, min_frequency=1)
    save_tokenizer(tokenizer, out)
    (out / "model.onnx").write_bytes(b"")
    graph = GraphInfo("model.onnx", "cuda", ["cls_embedding", "pooled_embedding", "token_embeddings"])
    manifest = Manifest(model_name="stand-in", hidden_size=hidden, num_layers=12, num_heads=12,
                        vocab_size=tokenizer.get_vocab_size(), max_length=512, max_position_embeddings=512, has_pooler=True,
                        has_nsp_head=False, lowercase=True,
                        special_tokens={t: tokenizer.token_to_id(t) for t in SPECIAL_TOKENS},
                        default_pooling="cls", default_normalize=False,
                        graphs={"fp16": graph}, weights_sha256="",
                        files_sha256={f: sha256_file(out / f) for f in ("model.onnx", "tokenizer.json")}, versions={}, created_at="")
    (out / "manifest.json").write_text(manifest.to_json())
    return out


def _engine(socket_path: str, core: int, hidden: int) -> None:
    """A stand-in engine process: the real link and batcher, answers at once with random vectors
    (orjson writes random floats slower than zeros)."""
    os.sched_setaffinity(0, {core})
    _fast_loop()
    from app.batcher import DynamicBatcher
    from app.backend import EngineInfo
    from app.multiprocess.engine_link import serve_workers

    rows = np.random.default_rng(0).standard_normal((256, hidden), dtype=np.float32)

    def run(batch):
        return {name: rows[:len(batch.input_ids)] for name in batch.outputs}

    async def serve():
        batcher = DynamicBatcher(run, pad_id=0, max_batch_tokens=16384, max_batch_size=256, max_wait_ms=0,
                                 max_queued=1 << 20, inference_workers=1, packed=True)
        batcher.start()
        info = EngineInfo("cuda", "fp16", "stand-in", None, 1, 16384, os.getpid(), False)
        server = await asyncio.get_running_loop().create_unix_server(serve_workers(batcher, info), path=socket_path)
        async with server:
            await asyncio.Event().wait()

    asyncio.run(serve())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(root: Path, artifact: Path, socket_path: str, metrics_dir: Path, core: int,
                 hidden: int) -> tuple:
    """One HTTP worker process of the tree at `root` (FLOOR: the --floor app), pinned to `core`; returns
    (process, url)."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("BERTSERVE_")}
    if root == FLOOR:
        command, cwd, paths = [sys.executable, "-c", _FLOOR, str(port), str(hidden)], ROOT, []
    else:
        command, cwd, paths = [sys.executable, "-c", _WORKER, str(port)], root, [str(root)]
    paths += [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []  # the caller's packages after
    env.update(BERTSERVE_MODEL_DIR=str(artifact), BERTSERVE_ENGINE_SOCKET=socket_path, BERTSERVE_LOG_LEVEL="warning",
               PROMETHEUS_MULTIPROC_DIR=str(metrics_dir), PYTHONPATH=os.pathsep.join(paths))
    proc = subprocess.Popen(command, cwd=cwd, env=env,
                            preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"the worker of {root} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"the worker of {root} was not ready in a minute")


async def load_window(url: str, pid: int, bodies: list[dict], connections: int, warm_up_s: float,
                      duration_s: float, path: str = "/embed") -> dict:
    """Keep `connections` requests to `path` in flight; count those answered within the window and the
    worker's CPU seconds over the same window."""
    async with open_connections(url, connections, path, bodies[0]) as conns:
        done = errors = 0
        stop_at = time.perf_counter() + warm_up_s + duration_s

        async def client(k: int, c) -> None:
            nonlocal done, errors
            i = k
            while time.perf_counter() < stop_at:
                status, _ = await c.post(path, bodies[i % len(bodies)])
                done += 1
                errors += status != 200
                i += connections

        tasks = [asyncio.ensure_future(client(k, c)) for k, c in enumerate(conns)]
        await asyncio.sleep(warm_up_s)
        cpu0, done0, t0 = _cpu_seconds(pid), done, time.perf_counter()
        await asyncio.sleep(duration_s)
        cpu1, done1, t1 = _cpu_seconds(pid), done, time.perf_counter()
        await asyncio.gather(*tasks)
    requests = done1 - done0
    return {"requests": requests, "errors": errors, "requests_per_s": requests / (t1 - t0),
            "cpu_us_per_request": (cpu1 - cpu0) / max(requests, 1) * 1e6, "worker_busy": (cpu1 - cpu0) / (t1 - t0)}


async def load_together(workers: list[tuple], bodies: list[dict], args: argparse.Namespace) -> list[dict]:
    """load_window on every worker at once (--together)."""
    return await asyncio.gather(*[load_window(url, proc.pid, bodies, args.connections, args.warm_up, args.duration,
                                              ROUTES[args.route]) for proc, url in workers])


def run_window(load, args: argparse.Namespace):
    """asyncio.run(load), stopped with one line when a worker stops answering instead of waiting forever
    (e.g. an --app-roots tree whose engine link differs from this checkout's, whose serve_workers the
    stand-in engine runs)."""
    limit = args.warm_up + args.duration + 60

    async def bounded():
        return await asyncio.wait_for(load, limit)
    try:
        return asyncio.run(bounded())
    except TimeoutError:
        raise SystemExit(f"a load window took over {limit:g} s: a worker stopped answering (with --app-roots, every "
                         f"tree's worker must speak this checkout's engine link)") from None


ROUTES = {"embed": "/embed", "openai": "/v1/embeddings"}  # --route


def request_bodies(texts: list[str], per_request: int, encoding_format: str, route: str = "embed") -> list[dict]:
    if route == "openai":  # as the openai client sends it
        return [{"input": texts[i:i + per_request], "model": "bench", "encoding_format": encoding_format}
                for i in range(0, len(texts) - per_request + 1, per_request)]
    return [{"inputs": texts[i:i + per_request], "pooling": "cls", "encoding_format": encoding_format}
            for i in range(0, len(texts) - per_request + 1, per_request)]


def profile_worker(pid: int, seconds: float, out: Path) -> subprocess.Popen:
    """py-spy (pip install py-spy) sampling the worker's stacks, collapsed, idle frames left out."""
    return subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--duration", str(max(1, round(seconds))),
                             "--rate", "250", "--format", "raw", "--output", str(out), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def summarise(runs: dict) -> list[dict]:
    rows = []
    for (root, texts, fmt), values in runs.items():
        us = [v["cpu_us_per_request"] for v in values]
        rows.append({"app_root": root, "texts_per_request": texts, "encoding_format": fmt,
                     "cpu_us_per_request": round(statistics.median(us), 1),
                     "cpu_us_per_text": round(statistics.median(us) / texts, 2),
                     "runs_us_per_request": [round(x, 1) for x in us],
                     "requests_per_s": round(statistics.median(v["requests_per_s"] for v in values), 1),
                     "worker_busy": round(statistics.median(v["worker_busy"] for v in values), 2),
                     "errors": sum(v["errors"] for v in values)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts-per-request", default="1,16,64")
    parser.add_argument("--formats", default="float,base64", help="encoding_format values to load")
    parser.add_argument("--app-roots", default=str(ROOT), help="source trees (each with app/ and artifact/), "
                        "one worker each, measured in turn every round")
    parser.add_argument("--artifact", type=Path, help="an artifact folder; default: a worker-only one made here")
    parser.add_argument("--hidden", type=int, default=768, help="width of the stand-in engine's vectors")
    parser.add_argument("--connections", type=int, default=16, help="requests kept in flight")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--together", action="store_true", help="load every tree's worker at the same time, all "
                        "on the one worker core: the host's speed swings (a quarter, from second to second on a "
                        "shared VM) then hit every tree alike. Fair only between trees that run the same threads "
                        "(the core is shared out by thread); no --profile")
    parser.add_argument("--route", choices=sorted(ROUTES), default="embed", help="embed: POST /embed (pooling "
                        "cls); openai: POST /v1/embeddings (the model's default pooling, as most clients ask)")
    parser.add_argument("--warm-up", type=float, default=1.0, help="seconds before each window")
    parser.add_argument("--duration", type=float, default=4.0, help="seconds of each measured window")
    parser.add_argument("--floor", action="store_true", help="also a worker that is only uvicorn and a plain "
                        "ASGI app answering stored vectors as JSON (app root `floor`): what HTTP and JSON cost "
                        "before this project's code")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--profile", type=Path, help="py-spy stacks of the (first) worker in the last round, one "
                        "file per load: PROFILE.<texts>.<format>.txt (collapsed stacks)")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    worker_core, load_core = cores[0], cores[-1]
    roots = [Path(r).resolve() for r in args.app_roots.split(",")] + ([FLOOR] if args.floor else [])
    sizes = [int(x) for x in args.texts_per_request.split(",")]
    formats = args.formats.split(",")
    texts = make_texts(4096, seed=0)
    with tempfile.TemporaryDirectory(prefix="worker-load-") as folder:
        folder = Path(folder)
        artifact = args.artifact or make_worker_artifact(folder / "artifact", args.hidden, make_texts(5000, seed=1))
        socket_path = str(folder / "engine.sock")
        copy_worker_files(artifact, worker_files_dir(socket_path))  # what an engine process keeps for its workers
        engine = multiprocessing.get_context("spawn").Process(target=_engine, daemon=True,
                                                              args=(socket_path, load_core, args.hidden))
        engine.start()
        while not os.path.exists(socket_path):
            time.sleep(0.05)
        os.sched_setaffinity(0, {load_core})  # the load generator shares its core with the stand-in engine
        _fast_loop()
        workers = []
        try:
            for k, root in enumerate(roots):
                (folder / f"metrics{k}").mkdir()
                workers.append(start_worker(root, artifact, socket_path, folder / f"metrics{k}", worker_core,
                                            args.hidden))
            runs: dict = {}

            def note(r: int, root: Path, texts_per_request: int, fmt: str, row: dict) -> None:
                runs.setdefault((str(root), texts_per_request, fmt), []).append(row)
                print(f"round {r + 1} {root.name or root}: {texts_per_request} text(s), {fmt}: "
                      f"{row['cpu_us_per_request']:.0f} us/request ({row['worker_busy']:.2f} busy)",
                      file=sys.stderr, flush=True)

            for r in range(args.rounds):
                if args.together:
                    for texts_per_request in sizes:
                        for fmt in formats:
                            bodies = request_bodies(texts, texts_per_request, fmt, args.route)
                            rows = run_window(load_together(workers, bodies, args), args)
                            for root, row in zip(roots, rows):
                                note(r, root, texts_per_request, fmt, row)
                    continue
                for root, (proc, url) in zip(roots, workers):
                    for texts_per_request in sizes:
                        for fmt in formats:
                            spy = None
                            if args.profile and r == args.rounds - 1 and root == roots[0]:
                                out = args.profile.with_suffix(f".{texts_per_request}.{fmt}.txt")
                                spy = profile_worker(proc.pid, args.warm_up + args.duration, out)
                            row = run_window(load_window(url, proc.pid,
                                                         request_bodies(texts, texts_per_request, fmt, args.route),
                                                         args.connections, args.warm_up, args.duration,
                                                         ROUTES[args.route]), args)
                            if spy:
                                spy.wait()
                            note(r, root, texts_per_request, fmt, row)
        finally:
            for proc, _ in workers:
                proc.terminate()
                proc.wait(30)
            engine.kill()
            engine.join()
    rows = summarise(runs)
    for row in rows:
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
