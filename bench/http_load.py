"""Load generator and CPU comparisons for the embedding server (loopback only, bounded in count and time).

  load     N concurrent clients against a running server: texts/s, p50 / p95 / p99 latency.
  compare  sentence-transformers' encode on the CPU (same weights, same texts, CLS pooling), the raw
           engine (the server's tokenizer + OrtEngine, no HTTP), and the server through HTTP (`python -m
           app` started here, load from this process); --device cuda --precision fp16: no s-t.
  formats  bytes and time per /embed response, float vs base64, with return_tokens.
  serving  the issue's GPU check in one command: the raw engine (app.engine, IO binding on CUDA) on the
           same texts in the batch sizes the batcher forms, then `python -m app` loaded by several client
           PROCESSES with single-text and 16-text /embed requests (cls), and one short text at
           concurrency 1; prints HTTP / engine ratios, writes http_serving.json under $OUT when set.

  python bench/http_load.py load --url http://127.0.0.1:8000 --concurrency 16 --requests 2000
  python bench/http_load.py compare --model-dir MODEL_DIR --artifact ARTIFACT_DIR --texts 512
  python bench/http_load.py formats --url http://127.0.0.1:8000
  python bench/http_load.py serving --artifact ARTIFACT_DIR --processes 8 --connections 16   # GPU box
The load generator is its own process: the server under test runs in another one.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import http.client
import json
import multiprocessing
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import orjson

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # `python bench/http_load.py` from a checkout: app/ is importable
    sys.path.insert(0, str(ROOT))

from bench.gpu_busy import gpu_busy  # noqa: E402

_WORDS = ("the of and to in is was for on that with as by at from his it an were are which this be or "
          "has had not but first one their its new after who they have her she two been other when there "
          "all during into school time may years more most only over city some world would where later up "
          "such used many can state about national out known university united then made people system "
          "search vector embedding server batch token model language query document retrieval cluster "
          "training export graph runtime kernel attention layer normalisation dynamic budget latency").split()


def add_text_length_arguments(parser: argparse.ArgumentParser) -> None:
    """--min-words / --max-words: the lengths of make_texts' texts, as `args.min_words`, `args.max_words`."""
    parser.add_argument("--min-words", type=int, default=6, help="text lengths: uniform in words (about 26 "
                        "tokens a text by default with bench/make_base_model.py's vocabulary; 10 to 70 words give 42.6)")
    parser.add_argument("--max-words", type=int, default=40)


def make_texts(n: int, seed: int = 0, min_words: int = 6, max_words: int = 40) -> list[str]:
    """Deterministic sentences of varied length (about 8 to 60 tokens with a BERT vocabulary)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words))).capitalize() + "."
            for _ in range(n)]


def _loopback(url: str) -> None:
    host = httpx.URL(url).host
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit(f"refusing to load {host}: this benchmark targets loopback servers only")


def _pct(values: list[float], p: float) -> float:
    return float(np.percentile(values, p)) if values else float("nan")


_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length: *(\d+)", re.IGNORECASE)


class RawConnection:
    """One keep-alive HTTP/1.1 connection with hand-built requests: tens of µs of client CPU per request
    where httpx spends about 2 ms, so that the load generator measures the server and not itself (on a
    2-core box it shares the cores with the server under test). Reads the whole body, parses nothing."""

    def __init__(self, url: str, headers: dict[str, str] | None = None):
        _loopback(url)
        u = httpx.URL(url)
        self.host, self.port = u.host, u.port
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._head = f"Host: {u.host}\r\nContent-Type: application/json\r\n{extra}".encode()
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> "RawConnection":
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def __aexit__(self, *exc) -> None:
        self.writer.close()

    async def post(self, path: str, body: dict) -> tuple[int, bytes]:
        data = orjson.dumps(body)
        self.writer.write(b"POST %s HTTP/1.1\r\n%sContent-Length: %d\r\n\r\n%s"
                          % (path.encode(), self._head, len(data), data))
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = _CONTENT_LENGTH.search(head)
        if length is None:
            raise RuntimeError(f"no content-length in {head[:200]!r}")
        return int(head[9:12]), await self.reader.readexactly(int(length.group(1)))


@contextlib.asynccontextmanager
async def open_connections(url: str, count: int, path: str, warm_up: dict, headers: dict[str, str] | None = None):
    """`count` keep-alive connections, each warmed up with one request of `warm_up` to `path`."""
    connections = [RawConnection(url, headers) for _ in range(count)]
    async with contextlib.AsyncExitStack() as stack:
        for c in connections:
            await stack.enter_async_context(c)
        await asyncio.gather(*(c.post(path, warm_up) for c in connections))
        yield connections


def _fast_loop() -> None:
    with contextlib.suppress(ImportError):
        import uvloop
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


async def run_load(url: str, texts: list[str], concurrency: int, per_request: int = 1, duration_s: float = 60.0,
                   body: dict | None = None, endpoint: str = "/embed", api_key: str | None = None) -> dict:
    """Send `texts` in requests of `per_request` from `concurrency` clients (one keep-alive connection
    each); stop early after duration_s."""
    chunks = [texts[i:i + per_request] for i in range(0, len(texts), per_request)]
    next_chunk = 0
    latencies: list[float] = []
    done_texts = errors = 0
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with open_connections(url, concurrency, endpoint, {"inputs": texts[:1], **(body or {})},
                                headers) as connections:
        started = time.perf_counter()
        deadline = started + duration_s

        async def worker(c: RawConnection) -> None:
            nonlocal next_chunk, done_texts, errors
            while next_chunk < len(chunks) and time.perf_counter() < deadline:
                chunk = chunks[next_chunk]
                next_chunk += 1
                t0 = time.perf_counter()
                status, _ = await c.post(endpoint, {"inputs": chunk, **(body or {})})
                latencies.append(time.perf_counter() - t0)
                if status == 200:
                    done_texts += len(chunk)
                else:
                    errors += 1

        await asyncio.gather(*(worker(c) for c in connections))
        wall = time.perf_counter() - started
    return {"texts": done_texts, "errors": errors, "wall_s": round(wall, 3),
            "texts_per_s": round(done_texts / wall, 1), "requests_per_s": round(len(latencies) / wall, 1),
            "p50_ms": round(_pct(latencies, 50) * 1e3, 2), "p95_ms": round(_pct(latencies, 95) * 1e3, 2),
            "p99_ms": round(_pct(latencies, 99) * 1e3, 2), "concurrency": concurrency, "per_request": per_request}


@contextlib.contextmanager
def serve(artifact: Path, root: Path = ROOT, **settings):
    """`python -m app` from the source tree `root` on a free loopback port, as deployed; yields its URL once
    /ready answers. A `model_dir` setting serves that artifact instead of `artifact`."""
    artifact = settings.pop("model_dir", artifact)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("BERTSERVE_")}
    env.update({f"BERTSERVE_{k.upper()}": str(v) for k, v in settings.items()})
    proc = subprocess.Popen([sys.executable, "-m", "app", "--model-dir", str(artifact), "--port", str(port),
                             "--log-level", "warning"], cwd=root, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def raw_engine(artifact: Path, texts: list[str], batch_size: int, device: str = "cpu", precision: str = "fp32") -> dict:
    """The floor under the server: its tokenizer and engine (app.engine.OrtEngine, IO binding on CUDA)
    called directly in fixed batches, no HTTP, no batcher. Texts are sorted by length first, as
    sentence-transformers' encode sorts them, so both pay the same (small) padding."""
    from app.engine import Batch, OrtEngine
    from artifact.manifest import read_manifest
    from tokenizers import Tokenizer

    manifest = read_manifest(artifact)
    tok = Tokenizer.from_file(str(artifact / "tokenizer.json"))
    tok.enable_truncation(manifest.max_length)
    tok.enable_padding(pad_id=manifest.special_tokens["[PAD]"])
    engine = OrtEngine(artifact, manifest, device, precision)

    def run(batch: list[str]) -> np.ndarray:
        encs = tok.encode_batch(batch)
        return engine.run(Batch(np.array([e.ids for e in encs], dtype=np.int64),
                                np.array([e.attention_mask for e in encs], dtype=np.int64),
                                np.array([e.type_ids for e in encs], dtype=np.int64), ("cls_embedding",)))

    texts = sorted(texts, key=lambda t: len(tok.encode(t).ids))
    run(texts[:batch_size])
    started = time.perf_counter()
    for i in range(0, len(texts), batch_size):
        run(texts[i:i + batch_size])
    wall = time.perf_counter() - started
    return {"texts": len(texts), "wall_s": round(wall, 3), "texts_per_s": round(len(texts) / wall, 1),
            "batch_size": batch_size, "device": device, "precision": precision}


def sentence_transformers_encode(model_dir: Path, texts: list[str], batch_size: int) -> dict:
    """sentence-transformers over the same weights (BERT + CLS pooling), as its users run it on a CPU."""
    from sentence_transformers import SentenceTransformer, models

    bert = models.Transformer(str(model_dir))
    model = SentenceTransformer(modules=[bert, models.Pooling(bert.get_word_embedding_dimension(), "cls")],
                                device="cpu")
    model.encode(texts[:batch_size], batch_size=batch_size)
    started = time.perf_counter()
    model.encode(texts, batch_size=batch_size)
    wall = time.perf_counter() - started
    return {"texts": len(texts), "wall_s": round(wall, 3), "texts_per_s": round(len(texts) / wall, 1),
            "batch_size": batch_size}


def formats(url: str, texts: list[str], repeats: int = 20, per_request: int = 8) -> dict:
    _loopback(url)
    out = {}
    with httpx.Client(base_url=url, timeout=120) as c:
        for fmt in ("float", "base64"):
            body = {"inputs": texts[:per_request], "return_tokens": True, "encoding_format": fmt}
            c.post("/embed", json=body)
            sizes, times = [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                r = c.post("/embed", json=body)
                times.append(time.perf_counter() - t0)
                sizes.append(len(r.content))
            out[fmt] = {"bytes_per_response": int(np.mean(sizes)), "ms_per_response": round(_pct(times, 50) * 1e3, 2),
                        "texts_per_request": per_request}
    return out


def compare(args) -> dict:
    """`--rounds` rounds, each timing sentence-transformers and then the server in every load pattern
    (the server stays up); medians per row, and each row's median over sentence-transformers' median.
    On a shared VM one timing of either side moves by 10-20%, so single rounds decide nothing."""
    texts = make_texts(args.texts, args.seed, args.min_words, args.max_words)
    patterns = ((args.concurrency, 1), (args.concurrency, 8), (4, 32))
    results: dict = {"texts": args.texts, "cpu_count": os.cpu_count(), "rounds": args.rounds}
    runs: dict[str, list[dict]] = {}
    with_st = not args.skip_st and args.device == "cpu"
    print("raw engine ...", file=sys.stderr)
    results["raw_engine"] = raw_engine(args.artifact, texts, args.batch_size, args.device, args.precision)
    extra = dict(item.split("=", 1) for item in args.set)
    with serve(args.artifact, precision=args.precision, device=args.device, **extra) as url:
        for r in range(args.rounds):
            if with_st:
                print(f"round {r + 1}: sentence-transformers ...", file=sys.stderr)
                try:
                    runs.setdefault("sentence_transformers", []).append(
                        sentence_transformers_encode(args.model_dir, texts, args.batch_size))
                except ImportError as e:
                    results["sentence_transformers"] = {"error": f"not installed ({e}): pip install sentence-transformers"}
                    with_st = False
            for concurrency, per_request in patterns:
                print(f"round {r + 1}: server, {concurrency} clients x {per_request} text(s) per request ...",
                      file=sys.stderr)
                runs.setdefault(f"server_c{concurrency}_x{per_request}", []).append(
                    asyncio.run(run_load(url, texts, concurrency, per_request, args.duration)))
        results["formats"] = formats(url, texts)
    for key, values in runs.items():
        rates = [v["texts_per_s"] for v in values]
        results[key] = {**values[-1], "texts_per_s": round(float(np.median(rates)), 1), "runs": rates}
    st = results.get("sentence_transformers", {}).get("texts_per_s")
    if st:
        for key, value in results.items():
            if isinstance(value, dict) and "texts_per_s" in value and key != "sentence_transformers":
                value["x_sentence_transformers"] = round(value["texts_per_s"] / st, 2)
    return results


# -- serving: engine vs HTTP under several client processes ----------------------------------------------
SHORT_TEXT = "The quick brown fox jumps over the lazy dog."


def engine_reference(artifact: Path, texts: list[str], batch_sizes: list[int], device: str, precision: str,
                     seconds: float) -> dict:
    """The server's own tokenizer, collation and engine with no HTTP and no batcher: texts/s at each batch
    size (the texts in arrival order, as the batcher sees them), and batch-1 latency of SHORT_TEXT."""
    from app.batcher import Sequences, collate
    from app.engine import OrtEngine, resolve_device_precision
    from app.tokenization import TextTokenizer
    from artifact.manifest import CLS_EMBEDDING, TOKENIZER_FILE, read_manifest
    import onnxruntime as ort

    manifest = read_manifest(artifact)
    device, precision = resolve_device_precision(device, precision, manifest, ort.get_available_providers())
    engine = OrtEngine(artifact, manifest, device, precision)
    tokenizer = TextTokenizer(artifact / TOKENIZER_FILE, manifest.max_length, 2_000_000, manifest.special_tokens)
    encoded = tokenizer.encode(texts, truncate=True)
    outputs = frozenset({CLS_EMBEDDING})

    def batch_of(encs):
        return collate(Sequences.concat([e.ids for e in encs], [e.type_ids for e in encs]), engine.pad_id, outputs)

    result = {"device": device, "precision": precision, "provider": engine.provider,
              "mean_tokens": round(float(np.mean([e.length for e in encoded])), 1), "texts_per_s": {}}
    for size in batch_sizes:
        batches = [batch_of(encoded[i:i + size]) for i in range(0, len(encoded) - size + 1, size)]
        for b in batches[:3]:
            engine.run(b)  # warm-up: CUDA kernels for these shapes
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            for b in batches:
                engine.run(b)
                done += size
        result["texts_per_s"][size] = round(done / (time.perf_counter() - started), 1)
    short = batch_of(tokenizer.encode([SHORT_TEXT], truncate=True))
    times = []
    for _ in range(20):
        engine.run(short)
    for _ in range(300):
        t0 = time.perf_counter()
        engine.run(short)
        times.append(time.perf_counter() - t0)
    result["batch1_short_p50_ms"] = round(_pct(times, 50) * 1e3, 3)
    result["best_texts_per_s"] = max(result["texts_per_s"].values())
    return result


def _client_process(url: str, texts: list[str], per_request: int, connections: int, start_at: float,
                    duration_s: float, seed: int, encoding_format: str = "float", pooling: str = "cls") -> dict:
    """One client process: `connections` closed-loop workers, one keep-alive connection each."""
    rng = random.Random(seed)
    _fast_loop()

    async def go() -> dict:
        latencies: list[float] = []
        errors = 0
        async with open_connections(url, connections, "/embed", {"inputs": SHORT_TEXT}) as conns:
            await asyncio.sleep(max(0.0, start_at - time.time()))
            cpu0, deadline = time.process_time(), time.perf_counter() + duration_s

            async def worker(c: RawConnection) -> None:
                nonlocal errors
                while time.perf_counter() < deadline:
                    i = rng.randrange(len(texts) - per_request + 1)
                    body = {"inputs": texts[i] if per_request == 1 else texts[i:i + per_request], "pooling": pooling,
                            "encoding_format": encoding_format}
                    t0 = time.perf_counter()
                    status, _ = await c.post("/embed", body)
                    latencies.append(time.perf_counter() - t0)
                    errors += status != 200

            await asyncio.gather(*(worker(c) for c in conns))
        return {"latencies": latencies, "errors": errors, "cpu_s": time.process_time() - cpu0}

    return asyncio.run(go())


def multiprocess_load(url: str, texts: list[str], per_request: int, processes: int, connections: int,
                      duration_s: float, encoding_format: str = "float",
                      server: tuple[int, set[int]] | None = None, pooling: str = "cls") -> dict:
    """processes x connections concurrent clients; also how busy the clients were (they must not be
    the bottleneck: client_cpu_share near 1.0 means add processes) and, given `server` (engine pid, all
    its pids), how busy its processes were over the same window."""
    _loopback(url)
    start_at = time.time() + 3.0  # every process connected and warmed up first
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(processes) as pool:
        pending = pool.starmap_async(_client_process, [(url, texts, per_request, connections, start_at, duration_s,
                                                        seed, encoding_format, pooling) for seed in range(processes)])
        server_cpu = None
        if server is not None:
            time.sleep(max(0.0, start_at - time.time()))
            server_cpu = _server_cpu_over(server, duration_s * 0.95)  # inside the clients' window
        parts = pending.get()
    latencies = [x for p in parts for x in p["latencies"]]
    errors = sum(p["errors"] for p in parts)
    answered = len(latencies) - errors  # a refused request (429 past the queue limits) is not throughput
    cpu = sum(p["cpu_s"] for p in parts)
    return {"client": "python", "clients": processes * connections, "processes": processes,
            "texts_per_request": per_request,
            "requests_per_s": round(answered / duration_s, 1), "texts_per_s": round(answered * per_request / duration_s, 1),
            "p50_ms": round(_pct(latencies, 50) * 1e3, 2), "p99_ms": round(_pct(latencies, 99) * 1e3, 2),
            "errors": errors,
            "client_cpu_us_per_request": round(cpu / max(len(latencies), 1) * 1e6, 1),
            "client_cpu_share": round(cpu / (processes * duration_s), 2),
            **({"server_cpu": server_cpu} if server_cpu else {})}


def wrk_load(url: str, texts: list[str], per_request: int, threads: int, connections: int, duration_s: float,
             encoding_format: str = "float", server: tuple[int, set[int]] | None = None, seed: int = 0,
             pooling: str = "cls") -> dict:
    """The same closed loop as multiprocess_load (the same bodies, threads x connections clients) from
    wrk (bench/wrk_load.py), with the server's CPU sampled over the same window."""
    from bench.wrk_load import start_wrk, wrk_result

    _loopback(url)
    rng = random.Random(seed)
    starts = [rng.randrange(len(texts) - per_request + 1) for _ in range(4096)]
    bodies = [orjson.dumps({"inputs": texts[i] if per_request == 1 else texts[i:i + per_request], "pooling": pooling,
                            "encoding_format": encoding_format}) for i in starts]
    wrk = start_wrk(url, bodies, threads, threads * connections, duration_s)
    server_cpu = None
    if server is not None:
        time.sleep(duration_s * 0.05)  # wrk connected
        server_cpu = _server_cpu_over(server, duration_s * 0.9)
    run = wrk_result(wrk, per_request, threads * connections)
    client_cores = run.pop("client_cores")
    if server_cpu is not None:  # over wrk's whole run, start-up included: /proc's 10 ms ticks over the window
        server_cpu["client_cores"] = client_cores  # cannot see a light load's client
    return {**run, "processes": threads,
            "client_cpu_us_per_request": round(client_cores / max(run["requests_per_s"], 1e-9) * 1e6, 1),
            "client_cpu_share": round(client_cores / threads, 3), **({"server_cpu": server_cpu} if server_cpu else {})}


def _sequential_latency(url: str, text: str, requests: int, pooling: str = "cls") -> dict:
    """One request at a time over one keep-alive connection of the standard library's http.client, whose
    own cost per request is tens of µs (httpx's is about 2 ms of CPU here, which would be counted as
    server latency). Also the server's own split of each request from its timing headers."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"inputs": text, "pooling": pooling}).encode()
    headers = {"Content-Type": "application/json"}
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    times, inference, total = [], [], 0.0
    for i in range(50 + requests):
        t0 = time.perf_counter()
        conn.request("POST", "/embed", body, headers)
        response = conn.getresponse()
        response.read()
        elapsed = time.perf_counter() - t0
        total += elapsed
        if response.status != 200:
            raise RuntimeError(f"/embed answered {response.status}")
        if i >= 50:  # after warm-up
            times.append(elapsed)
            inference.append(float(response.getheader("x-inference-ms", "nan")))
    conn.close()
    return {"p50_ms": round(_pct(times, 50) * 1e3, 3), "p99_ms": round(_pct(times, 99) * 1e3, 3),
            "server_inference_p50_ms": round(float(np.median(inference)), 3), "client": "http.client keep-alive",
            # over every request, warm-up too: what the server's means over the same window compare with
            "mean_with_warm_up_ms": round(total / (50 + requests) * 1e3, 3)}


def _wrk_sequential_latency(url: str, text: str, seconds: float, pooling: str = "cls") -> dict:
    """One request at a time over one connection of wrk (issue 15 measured its lone text so): the client's
    own time per request is a few µs where http.client's is tens."""
    from bench.wrk_load import start_wrk, wrk_result

    run = wrk_result(start_wrk(url, [orjson.dumps({"inputs": text, "pooling": pooling})], 1, 1, seconds), 1, 1)
    if run["errors"]:
        raise RuntimeError(f"/embed failed {run['errors']} times under wrk at concurrency 1")
    return {"p50_ms": run["p50_ms"], "p99_ms": run["p99_ms"], "requests": run["wrk"]["requests"],
            "client": "wrk, one connection"}


_LINK = "bertserve_engine_link_duration_seconds"  # with workers > 1, by way (label): to / in / from the engine
_STAGES = {"request": "bertserve_request_duration_seconds", "tokenize": "bertserve_tokenize_duration_seconds",
           "queue": "bertserve_queue_duration_seconds", "inference": "bertserve_inference_duration_seconds",
           **{f"link_{way}": f"{_LINK}:{way}" for way in ("to_engine", "in_engine", "from_engine")}}
_BATCH_SIZE = "bertserve_batch_size"
_BUSY = "bertserve_engine_busy_seconds_total"  # by path (label): cuda_graph / session


def _server_totals(url: str) -> dict[str, float]:
    """Each histogram's _sum and _count so far, from /metrics (summed over label values, but the link's
    by way, as NAME:WAY_sum): differences over a run give the mean batch size and where the server's
    time per request went."""
    wanted = {*(stage.split(":")[0] for stage in _STAGES.values()), _BATCH_SIZE}
    totals: dict[str, float] = {"at": time.monotonic()}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name == _BUSY and 'path="' in line:
            totals["busy:" + line.split('path="', 1)[1].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
            continue
        base, suffix = name.rsplit("_", 1) if "_" in name else (name, "")
        if suffix in ("sum", "count") and base in wanted:
            if base == _LINK and 'way="' in line:
                base += ":" + line.split('way="', 1)[1].split('"', 1)[0]
            key = f"{base}_{suffix}"
            totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def _server_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Over a run: the mean batch size, mean ms per request in the worker's handler (request), in
    tokenising, waiting for its batch (queue), and per batch in the engine (inference); and how busy the
    engine's threads were on batches, by path (seconds a second: 0.8 is one thread busy 80% of the run)."""
    def mean(metric: str) -> float:
        count = after.get(f"{metric}_count", 0.0) - before.get(f"{metric}_count", 0.0)
        return (after.get(f"{metric}_sum", 0.0) - before.get(f"{metric}_sum", 0.0)) / max(count, 1)

    def rate(key: str) -> float:
        return (after.get(key, 0.0) - before.get(key, 0.0)) / max(after["at"] - before["at"], 1e-9)

    return {"mean_batch_size": round(mean(_BATCH_SIZE), 1),
            **{f"server_{stage}_ms": round(mean(metric) * 1e3, 3) for stage, metric in _STAGES.items()},
            **{f"engine_busy_{path}": round(rate(f"busy:{path}"), 2) for path in ("cuda_graph", "session")}}


def _stages_line(means: dict, workers: int) -> str:
    """Where a request's time went in the server (`_server_means`), in words."""
    return (f"handler {means['server_request_ms']} ms (tokenising {means['server_tokenize_ms']}, waiting for its "
            f"batch {means['server_queue_ms']}), {means['server_inference_ms']} ms per batch of "
            f"{means['mean_batch_size']}" + (
                f"; engine link: to {means['server_link_to_engine_ms']}, in the engine process "
                f"{means['server_link_in_engine_ms']}, back {means['server_link_from_engine_ms']} ms"
                if workers > 1 else ""))


def require_fast_protocols(allow_slow: bool) -> None:
    """The server runs on this interpreter: without uvloop and httptools (uvicorn[standard]) it serves on
    asyncio's loop and the pure-Python h11 parser, about 15% fewer one-text requests/s on an H100 host
    (BENCHMARKS.md): a figure measured so says nothing about the deployed server."""
    import importlib.util

    missing = [name for name in ("uvloop", "httptools") if importlib.util.find_spec(name) is None]
    if missing and not allow_slow:
        raise SystemExit(f"{' and '.join(missing)} not installed: the server would run without its fast event "
                         f"loop / HTTP parser (pip install 'uvicorn[standard]'), or pass --allow-slow-protocols")


def serving(args) -> dict:
    require_fast_protocols(args.allow_slow_protocols)
    texts = make_texts(args.texts, args.seed, args.min_words, args.max_words)
    batch_sizes = [int(x) for x in args.engine_batches.split(",")]
    print("raw engine ...", file=sys.stderr)
    engine = engine_reference(args.artifact, texts, batch_sizes, args.device, args.precision, args.engine_seconds)
    results = {"cpu_count": os.cpu_count(), "engine": engine, "http": {}, "server_settings": args.set,
               "encoding_format": args.encoding_format, "pooling": args.pooling}
    for workers in [int(x) for x in args.workers.split(",")]:
        results["http"][f"workers{workers}"] = serve_and_load(args, server_settings(args, workers), texts, engine)
    return results


def server_settings(args, workers: int, extra: list[str] = ()) -> dict:
    """The BERTSERVE_* settings of a server under load: device, precision, workers, then each --set, then
    each NAME=VALUE of `extra`."""
    settings = {"device": args.device, "precision": args.precision, "max_wait_ms": args.max_wait_ms,
                "workers": workers}
    if args.inference_workers:
        settings["inference_workers"] = args.inference_workers
    settings.update(item.split("=", 1) for item in [*args.set, *extra])
    return settings


def serve_and_load(args, settings: dict, texts: list[str], engine: dict | None, root: Path = ROOT) -> dict:
    """One server (`python -m app` from the source tree `root`, with `settings`) loaded at every request
    size by every client in turn, then one short text at concurrency 1: its runs, keyed x{size}[-client][-n]
    and c1_short. `engine` (engine_reference), when given, scales them (x_engine, over_engine_ms)."""
    runs, workers = {}, int(settings["workers"])
    with serve(args.artifact, root=root, **settings) as url:
        engine_pid, worker_pids = _all_workers_up(url, workers)
        server_pids = {engine_pid, *worker_pids}
        for per_request in [int(x) for x in args.texts_per_request.split(",")]:
            # Fewer connections for larger requests: about max_inflight_texts in flight in every run.
            connections = max(1, min(args.connections, args.max_inflight_texts // (per_request * args.processes)))
            runs_of = collections.Counter()  # client -> its runs so far at this request size
            for client in args.clients.split(","):
                before = _server_totals(url)
                units = "threads" if client == "wrk" else "processes"
                print(f"HTTP, {workers} server process(es): {client}, {args.processes} {units} x {connections} "
                      f"connections, {per_request} text(s) per request ...", file=sys.stderr)
                with gpu_busy(int(settings.get("cuda_device_id", 0))) if settings.get("device") == "cuda" \
                        else contextlib.nullcontext({}) as busy:
                    run = _one_load(args, client, url, texts, per_request, connections, engine_pid, server_pids)
                run.update(busy)
                run.update(_server_means(before, _server_totals(url)))
                run["mean_ms"] = round(1e3 * run["clients"] / max(run["requests_per_s"], 1e-9), 2)  # Little's law
                print(f"  {run['requests_per_s']:,.0f} requests/s, {run['mean_ms']} ms a request at the client; in the "
                      f"server: " + _stages_line(run, workers) + f"; engine threads busy on batches: CUDA graphs "
                      f"{run['engine_busy_cuda_graph']}, session {run['engine_busy_session']} s/s" + (
                          f"; GPU busy {run['gpu_busy_percent']}%" if "gpu_busy_percent" in run else "") + (
                          _cpu_line(run["server_cpu"]) if "server_cpu" in run else ""),
                      file=sys.stderr)
                if engine is not None:
                    run["x_engine"] = round(run["texts_per_s"] / engine["best_texts_per_s"], 3)
                runs_of[client] += 1  # x1, x1-wrk, then x1-2, x1-wrk-2 for a client's second run
                runs[f"x{per_request}" + ("" if client == "python" else f"-{client}")
                     + (f"-{runs_of[client]}" if runs_of[client] > 1 else "")] = run
        print("HTTP: one short text at concurrency 1 ...", file=sys.stderr)
        before = _server_totals(url)
        one = _sequential_latency(url, SHORT_TEXT, args.latency_requests, args.pooling)
        one["server"] = _server_means(before, _server_totals(url))  # its warm-up requests included
        print(f"  p50 {one['p50_ms']} ms; in the server: " + _stages_line(one["server"], workers), file=sys.stderr)
        runs["c1_short"] = one
        if "wrk" in args.clients.split(","):  # the same from wrk, whose own time per request is a few µs
            one = runs["c1_short_wrk"] = _wrk_sequential_latency(url, SHORT_TEXT, max(2.0, args.duration / 2),
                                                                 args.pooling)
            print(f"  wrk, one connection: p50 {one['p50_ms']} ms, p99 {one['p99_ms']} ms", file=sys.stderr)
        for key in ("c1_short", "c1_short_wrk"):
            if engine is not None and key in runs:
                runs[key]["over_engine_ms"] = round(runs[key]["p50_ms"] - engine["batch1_short_p50_ms"], 3)
    return runs


def _one_load(args, client: str, url: str, texts: list[str], per_request: int, connections: int, engine_pid: int,
              server_pids: set[int]) -> dict:
    if client == "wrk":
        return wrk_load(url, texts, per_request, args.processes, connections, args.duration, args.encoding_format,
                        (engine_pid, server_pids), args.seed, args.pooling)
    return multiprocess_load(url, texts, per_request, args.processes, connections, args.duration,
                             args.encoding_format, (engine_pid, server_pids), args.pooling)


def _all_workers_up(url: str, workers: int, timeout_s: float = 120) -> tuple[int, set[int]]:
    """/ready answers once one worker is up; wait until every worker answers /info. (engine pid, worker pids)."""
    deadline = time.monotonic() + timeout_s
    while True:
        infos = [httpx.get(f"{url}/info", timeout=5).json() for _ in range(4 * workers)]
        pids = {i["pid"] for i in infos}
        if len(pids) >= workers or time.monotonic() > deadline:
            break
        time.sleep(1)
    if len(pids) < workers:
        print(f"warning: saw fewer than {workers} worker processes answer", file=sys.stderr)
    return infos[0]["engine_pid"], pids


def _cpu_seconds(engine_pid: int, pids: set[int]) -> dict[str, float]:
    """User + system CPU seconds so far of each server process ("p PID", all its threads), of each thread
    of the engine process ("t TID") and of the whole host ("host": every core's busy time from /proc/stat)
    (Linux /proc; {} elsewhere)."""
    ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    files = {f"p {pid}": Path(f"/proc/{pid}/stat") for pid in pids}
    with contextlib.suppress(OSError):
        files.update({f"t {t.name}": t / "stat" for t in Path(f"/proc/{engine_pid}/task").iterdir()})
    out = {}
    for key, path in files.items():
        with contextlib.suppress(OSError):
            fields = path.read_text().rsplit(")", 1)[1].split()
            out[key] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
    with contextlib.suppress(OSError):
        # cpu user nice system idle iowait irq softirq steal ...: busy is all but idle and iowait
        times = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
        out["host"] = (sum(times) - times[3] - times[4]) / ticks
    return out


def _server_cpu_over(server: tuple[int, set[int]], seconds: float) -> dict:
    """_server_cpu over the next `seconds` (this thread sleeps meanwhile); `server`: (engine pid, all pids)."""
    cpu0, t0 = _cpu_seconds(*server), time.perf_counter()
    time.sleep(seconds)
    return _server_cpu(cpu0, _cpu_seconds(*server), server[0], time.perf_counter() - t0)


def _server_cpu(before: dict[str, float], after: dict[str, float], engine_pid: int, seconds: float) -> dict:
    """Cores kept busy over a run: the engine process and its busiest thread, the HTTP workers together,
    and the busiest worker (near 1.0: that process, or that thread, is the limit); where measured, the
    whole host (near os.cpu_count(): the host itself is the limit)."""
    busy = {key: (after[key] - before[key]) / seconds for key in after if key in before}
    workers = [v for key, v in busy.items() if key.startswith("p ") and key != f"p {engine_pid}"]
    threads = [v for key, v in busy.items() if key.startswith("t ")]
    return {"engine_cores": round(busy.get(f"p {engine_pid}", float("nan")), 2),
            "engine_busiest_thread": round(max(threads, default=float("nan")), 2),
            "workers_cores": round(sum(workers), 2), "busiest_worker": round(max(workers, default=float("nan")), 2),
            **({"host_cores": round(busy["host"], 2)} if "host" in busy else {})}


def _cpu_line(c: dict) -> str:
    """Where the host's cores went during a run, for the per-run line."""
    return (f"; cores busy: engine {c['engine_cores']} (busiest thread {c['engine_busiest_thread']}), workers "
            f"{c['workers_cores']} (busiest {c['busiest_worker']})"
            + (f", client {c['client_cores']}" if "client_cores" in c else "")
            + (f", host {c['host_cores']} of {os.cpu_count()}" if "host_cores" in c else ""))


def _cores(c: dict | None) -> str:
    if not c:
        return "-"
    return f"{c['engine_cores']} ({c.get('engine_busiest_thread', '-')}) / {c['workers_cores']} / {c['busiest_worker']}"


def print_serving_table(r: dict) -> None:
    e = r["engine"]
    print(f"engine ({e['provider']}, {e['precision']}, mean {e['mean_tokens']} tokens/text): "
          + ", ".join(f"b{b} {v:,.0f} texts/s" for b, v in e["texts_per_s"].items())
          + f"; batch-1 short text p50 {e['batch1_short_p50_ms']} ms")
    print(f"{'HTTP /embed (cls)':<34}{'texts/s':>10}{'req/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'batch':>7}"
          f"{'x engine':>10}{'client us/req':>15}{'client cpu':>12}{'engine (thread) / workers / busiest, cores':>44}")
    for workers, runs in r["http"].items():
        for h in (run for key, run in runs.items() if key.startswith("x")):  # one per request size, in turn
            label = f"{workers}, {h['texts_per_request']} text(s), {h['clients']} {h.get('client', 'python')}"
            print(f"{label:<34}{h['texts_per_s']:>10,.0f}{h['requests_per_s']:>10,.0f}{h['p50_ms']:>9}{h['p99_ms']:>9}"
                  f"{h['mean_batch_size']:>7}{h['x_engine']:>10}{h['client_cpu_us_per_request']:>15}"
                  f"{h['client_cpu_share']:>12}{_cores(h.get('server_cpu')):>44}")
        c1 = runs["c1_short"]
        print(f"{workers}, one short text, concurrency 1: p50 {c1['p50_ms']} ms (engine batch-1 "
              f"{e['batch1_short_p50_ms']} ms, +{c1['over_engine_ms']} ms), p99 {c1['p99_ms']} ms; server's "
              f"x-inference-ms p50 {c1['server_inference_p50_ms']} ms")
        if "c1_short_wrk" in runs:
            c1 = runs["c1_short_wrk"]
            print(f"{workers}, one short text, concurrency 1, wrk: p50 {c1['p50_ms']} ms "
                  f"(+{c1['over_engine_ms']} ms), p99 {c1['p99_ms']} ms")
    print("targets: x engine >= 0.85; +ms over engine <= 2; client cpu share well under 1.0 (else add --processes)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    load = sub.add_parser("load", help="load a running server")
    load.add_argument("--url", default="http://127.0.0.1:8000")
    load.add_argument("--concurrency", type=int, default=16)
    load.add_argument("--requests", type=int, default=1000, help="requests to send (at most)")
    load.add_argument("--texts-per-request", type=int, default=1)
    load.add_argument("--duration", type=float, default=60, help="stop after this many seconds")
    load.add_argument("--endpoint", default="/embed")
    load.add_argument("--api-key", default=os.environ.get("BERTSERVE_API_KEY"))
    fmt = sub.add_parser("formats", help="response size and time, float vs base64, with return_tokens")
    fmt.add_argument("--url", default="http://127.0.0.1:8000")
    cmp_ = sub.add_parser("compare", help="sentence-transformers vs raw ORT vs the server through HTTP (CPU)")
    cmp_.add_argument("--model-dir", type=Path, required=True, help="the BERT model folder that was exported")
    cmp_.add_argument("--artifact", type=Path, required=True, help="its artifact folder (python -m export)")
    cmp_.add_argument("--texts", type=int, default=512)
    add_text_length_arguments(cmp_)
    cmp_.add_argument("--batch-size", type=int, default=32, help="sentence-transformers' and the raw engine's")
    cmp_.add_argument("--concurrency", type=int, default=16)
    cmp_.add_argument("--duration", type=float, default=120)
    cmp_.add_argument("--skip-st", action="store_true")
    cmp_.add_argument("--rounds", type=int, default=3, help="sentence-transformers + server rounds (medians)")
    cmp_.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                      help="a server setting, e.g. --set max_padding=1.0 (repeatable)")
    cmp_.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    cmp_.add_argument("--precision", choices=["fp32", "fp16", "int8"], default="fp32")
    srv = sub.add_parser("serving", help="engine vs HTTP with several client processes (the GPU check)")
    srv.add_argument("--artifact", type=Path, required=True, help="artifact folder (python -m export)")
    srv.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    srv.add_argument("--precision", choices=["auto", "fp32", "fp16", "int8"], default="auto")
    srv.add_argument("--texts", type=int, default=4096)
    add_text_length_arguments(srv)
    srv.add_argument("--engine-batches", default="1,8,32,64,128,256", help="batch sizes for the raw engine")
    srv.add_argument("--workers", default="1,4", help="server process counts to load, one server each")
    srv.add_argument("--engine-seconds", type=float, default=3.0, help="per batch size")
    srv.add_argument("--processes", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                     help="client processes (default: half the cores; the server needs the rest)")
    srv.add_argument("--connections", type=int, default=16, help="concurrent connections per client process "
                     "(at most; fewer for larger requests, see --max-inflight-texts)")
    srv.add_argument("--max-inflight-texts", type=int, default=2048, help="texts in flight over all connections")
    srv.add_argument("--duration", type=float, default=15.0, help="seconds per HTTP run")
    srv.add_argument("--latency-requests", type=int, default=2000)
    srv.add_argument("--max-wait-ms", type=float, default=0.0, help="the server's setting")
    srv.add_argument("--inference-workers", type=int, default=0, help="the server's setting (0: its default)")
    srv.add_argument("--encoding-format", choices=["float", "base64"], default="float",
                     help="how /embed answers the vectors (the openai client asks for base64)")
    srv.add_argument("--pooling", default="cls", help="/embed's pooling in every request (mean: what most "
                     "sentence-transformers models answer)")
    srv.add_argument("--texts-per-request", default="1,16,64", help="request sizes to load, in turn")
    srv.add_argument("--clients", default="python", help="load generators, in turn for every request size: "
                     "python (--processes client processes), wrk (--processes threads of one wrk; bench/wrk_load.py)")
    srv.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                     help="a server setting, e.g. --set max_batch_size=128 (repeatable)")
    srv.add_argument("--allow-slow-protocols", action="store_true",
                     help="measure even without uvloop / httptools installed (the figures are then not the server's)")
    for p in (load, fmt, cmp_, srv):
        p.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    _fast_loop()

    if args.command == "load":
        texts = make_texts(args.requests * args.texts_per_request, args.seed)
        result = asyncio.run(run_load(args.url, texts, args.concurrency, args.texts_per_request, args.duration,
                                      endpoint=args.endpoint, api_key=args.api_key))
    elif args.command == "formats":
        result = formats(args.url, make_texts(64, args.seed))
    elif args.command == "serving":
        result = serving(args)
        print_serving_table(result)
        if os.environ.get("OUT"):
            path = Path(os.environ["OUT"]) / "http_serving.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(result, indent=2))
            print(f"wrote {path}", file=sys.stderr)
        return 0
    else:
        result = compare(args)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
