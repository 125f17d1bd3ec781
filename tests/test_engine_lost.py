"""A CUDA error that leaves the device unusable (CUDA's sticky errors, as ONNX Runtime reports them): the
batch's requests are answered 503, the one-process app answers 503 from then on, and the engine process
exits 1 so that the launcher stops the server for its supervisor to restart. Without a GPU, ONNX Runtime's
failure is stood in for by raising its message, word for word as an H200 gave it, from the engine's
batch; everything around it is the real tokenizer, engine, batcher, link and app. On a GPU (marked gpu),
a real illegal memory access checks that this onnxruntime-gpu still words it so."""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from app import errors
from app.build import build_engine, load_tokenizer
from app.engine import STICKY_CUDA_ERRORS, OrtEngine, device_lost
from app.metrics import Metrics
from app.multiprocess import engine_process
from app.multiprocess.engine_link import EngineClient
from app.settings import Settings
from artifact.manifest import CLS_EMBEDDING
from tests.test_app import serving
from tests.test_engine_link import _sequences

# Two of ONNX Runtime's messages from one H200 (bench/results/h200-cuda-graph-replay-illegal-access.log).
IN_A_REPLAY = ("Error in execution: CUDA failure 700: an illegal memory access was encountered ; GPU=0 ; "
               "hostname=vm ; file=/onnxruntime_src/onnxruntime/core/providers/cuda/cuda_graph.cc ; line=85 ; "
               "expr=cudaStreamSynchronize(stream_); ")
IN_A_NODE = ("Error in execution: Non-zero status code returned while running RemovePadding node. "
             "Name:'RemovePadding_0' Status Message: CUDA failure 700: an illegal memory access was encountered ; "
             "GPU=0 ; hostname=vm ; file=/onnxruntime_src/onnxruntime/contrib_ops/cuda/bert/remove_padding.cc ; "
             "line=81 ; expr=cudaGetLastError(); ")

# One of our operators meeting it first (custom_kernels/src/op_common.h words CUDA's errors as ORT does):
# the first sync after the embedding lookup is our RemovePadding's, in the kernels graph.
IN_OUR_NODE = ("Error in execution: Non-zero status code returned while running RemovePadding node. "
               "Name:'RemovePadding_0' Status Message: RemovePadding: copying the token count to the host failed: "
               "CUDA failure 717: operation not supported on global/shared address space (cudaErrorInvalidAddressSpace)")


def test_sticky_cuda_errors_are_told_from_the_others():
    for message in (IN_A_REPLAY, IN_A_NODE):
        lost = device_lost(RuntimeError(message))
        assert isinstance(lost, errors.EngineLost) and lost.status == 503
        assert str(lost) == ("the GPU can run nothing more in this process (CUDA error 700: an illegal memory "
                             "access was encountered); the server must be restarted")
    lost = device_lost(RuntimeError(IN_OUR_NODE))
    assert isinstance(lost, errors.EngineLost) and "CUDA error 717: operation not supported" in str(lost)
    # out of memory, and an error that is no CUDA error at all, leave the device usable
    assert device_lost(RuntimeError("CUDA failure 2: out of memory ; GPU=0 ; expr=cudaMalloc(&p, bytes);")) is None
    assert device_lost(RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid dimensions")) is None


@pytest.fixture
def device_fails(monkeypatch):
    """Every batch the engine runs from now on meets ONNX Runtime's sticky CUDA error."""
    def fail(self, batch):
        raise RuntimeError(IN_A_REPLAY)
    return lambda: monkeypatch.setattr(OrtEngine, "_run_batch", fail)


def test_the_one_process_app_answers_503_once_the_device_is_lost(tiny_artifact_dir, device_fails):
    async def go():
        async with serving(tiny_artifact_dir) as (client, _):
            assert (await client.post("/embed", json={"inputs": "before"})).status_code == 200
            device_fails()
            first = await client.post("/embed", json={"inputs": "the batch that meets it"})
            later = await client.post("/embed", json={"inputs": "after"})
            ready = await client.get("/ready")
            return first, later, ready
    first, later, ready = asyncio.run(go())
    assert first.status_code == 503 and first.headers["Retry-After"] == "1"
    assert first.json()["error"]["type"] == "not_ready"
    assert "CUDA error 700" in first.json()["error"]["message"]
    assert later.status_code == 503 and ready.status_code == 503
    assert "the engine is gone" in later.json()["error"]["message"], later.text  # not "not loaded yet"


def test_the_engine_process_answers_503_then_stops(tiny_artifact_dir, short_tmp_dir, device_fails, monkeypatch):
    """engine_process._serve, in this process: the batch's request crosses the link as EngineLost (503),
    and _serve stops, saying so (its process then exits 1, which the launcher reads as a dead engine:
    test_server.test_a_dead_engine_process_stops_the_server)."""
    monkeypatch.setenv("BERTSERVE_MODEL_DIR", str(tiny_artifact_dir))
    socket_path = str(short_tmp_dir / "engine.sock")

    async def go():
        serve = asyncio.create_task(engine_process._serve(Settings(), socket_path))
        while not serve.done() and not os.path.exists(socket_path):
            await asyncio.sleep(0.05)
        client = EngineClient(socket_path)
        await client.connect()
        _, tokenizer = load_tokenizer(Settings())
        device_fails()
        with pytest.raises(errors.EngineLost, match="CUDA error 700"):
            await client.submit_group(_sequences(tokenizer, ["the batch that meets it"]), frozenset({CLS_EMBEDDING}))
        with contextlib.suppress(Exception):
            await client.stop()
        return await asyncio.wait_for(serve, 30)
    assert asyncio.run(go()) is True


def test_the_batcher_fails_the_lost_batch_and_calls_back(tiny_artifact_dir, device_fails):
    calls = []

    async def go():
        settings = Settings(model_dir=tiny_artifact_dir)
        manifest, tokenizer = load_tokenizer(settings)
        _, batcher = build_engine(settings, manifest, tokenizer, Metrics(), lambda: calls.append(True))
        batcher.start()
        try:
            device_fails()
            with pytest.raises(errors.EngineLost):
                await batcher.submit_group(_sequences(tokenizer, ["one"]), frozenset({CLS_EMBEDDING}))
        finally:
            await batcher.stop()
    asyncio.run(go())
    assert calls == [True]


@pytest.mark.gpu
def test_a_real_illegal_memory_access_is_told_as_engine_lost(tiny_model_dir, tmp_path):
    """Token ids far past the embedding table make the embedding lookup read outside any allocation: a
    sticky CUDA error (an H100 gave 717, invalid address space), reported by this onnxruntime-gpu in its
    own words. In a child process, whose CUDA context is unusable after it."""
    from export.pipeline import export_artifact
    export_artifact(tiny_model_dir, tmp_path / "art", device="cuda")
    script = textwrap.dedent(f"""
        import numpy as np
        from pathlib import Path
        from app.engine import Batch, OrtEngine
        from app.errors import EngineLost
        from artifact.manifest import CLS_EMBEDDING, read_manifest
        art = Path({str(tmp_path / "art")!r})
        manifest = read_manifest(art)
        engine = OrtEngine(art, manifest, "cuda", "fp16", cuda_graphs="off")
        far = (2**31 - 1) // manifest.hidden_size  # the lookup's offset, in elements, still fits an int32
        ids = np.full((1, 8), far, np.int64)
        try:
            engine.run(Batch(ids, np.ones_like(ids), np.zeros_like(ids), (CLS_EMBEDDING,)))
        except EngineLost as e:
            print(e)
        else:
            print("no error")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    told = re.fullmatch(r"the GPU can run nothing more in this process \(CUDA error (\d+): .+\); the server must "
                        r"be restarted", done.stdout.strip())
    assert told and int(told.group(1)) in STICKY_CUDA_ERRORS, done.stdout
