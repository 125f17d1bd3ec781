"""Export with --device cuda: the fp16 graph is fused, converted and parity-checked on the GPU.

Skipped without CUDA and onnxruntime-gpu (see conftest); run on the GPU machine with `pytest -m gpu`."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from artifact.manifest import (CLS_EMBEDDING, GRAPH_FILES, INPUT_NAMES, POOLED_EMBEDDING, TOKEN_EMBEDDINGS,
                               read_manifest)
from artifact.session import open_session
from export.__main__ import main
from export.onnx_graph import EmbeddingGraph
from export.parity import reference_outputs
from export.pipeline import export_artifact
from tests.feeds import padded_feed
from training.model import BertForPreTraining, preset_config
from training.model_folder import load_model_folder, save_model_folder

pytestmark = pytest.mark.gpu


def cosine(a, b):
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def test_fp16_graph_built_and_checked_on_cuda(tiny_model_dir, tmp_path):
    out = tmp_path / "art"
    assert main(["--model", str(tiny_model_dir), "--out", str(out), "--device", "cuda", "--int8",
                 "--no-cuda-graphs"]) == 0
    m = read_manifest(out)
    assert set(m.graphs) == {"fp32", "fp16", "int8"}
    assert m.graph("fp16").padded is None and m.graph("fp16").host_packed is None
    fp16 = m.graph("fp16")
    assert fp16.file == GRAPH_FILES["fp16"] and fp16.device == "cuda"
    assert fp16.fused_operators["Attention"] + fp16.fused_operators["MultiHeadAttention"] == m.num_layers
    assert fp16.fused_operators["EmbedLayerNormalization"] == 1
    # padding removed by default, on the attention operator that is faster with the graph the server runs
    packed = "PackedMultiHeadAttention" if fp16.custom_kernels else "PackedAttention"
    assert fp16.fused_operators[packed] == m.num_layers
    assert fp16.parity["token_embeddings_min_cosine"] >= 0.999 and fp16.parity["nsp_prob_max_diff"] <= 0.01

    session = open_session(out / fp16.file, "cuda")
    assert session.get_providers()[0] == "CUDAExecutionProvider"
    # keep_io_types: the server feeds int64 and reads float32, no casts of its own
    assert [i.type for i in session.get_inputs()] == ["tensor(int64)"] * 3
    assert {o.type for o in session.get_outputs()} == {"tensor(float)"}

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    feed = padded_feed([tok.encode("a short one"),
                        tok.encode("a much longer sentence with more words in it", "and a pair")])
    loaded = load_model_folder(tiny_model_dir)
    want = reference_outputs(EmbeddingGraph(loaded.model, True, True), feed)
    got = dict(zip(fp16.outputs, session.run(fp16.outputs, feed)))
    real = feed["attention_mask"].astype(bool)
    assert cosine(got[TOKEN_EMBEDDINGS][real], want[TOKEN_EMBEDDINGS][real]).min() >= 0.999
    assert cosine(got[CLS_EMBEDDING], want[CLS_EMBEDDING]).min() >= 0.999
    assert cosine(got[POOLED_EMBEDDING], want[POOLED_EMBEDDING]).min() >= 0.999


def test_keep_padding_fp16_graph(tiny_model_dir, tmp_path):
    m = export_artifact(tiny_model_dir, tmp_path / "art", device="cuda", remove_padding=False)
    fp16 = m.graph("fp16")
    assert "PackedAttention" not in fp16.fused_operators and fp16.fused_operators["Attention"] == m.num_layers
    assert fp16.parity["cls_embedding_min_cosine"] >= 0.999


def test_packed_multi_head_attention_graph(tiny_model_dir, tmp_path):
    """The packed graph on PackedMultiHeadAttention (Q, K, V products before it) passes the same gate and
    answers a padded batch as the model does, with padding in the batch to remove."""
    m = export_artifact(tiny_model_dir, tmp_path / "art", device="cuda", packed_attention="PackedMultiHeadAttention",
                        cuda_graphs=False)
    fp16 = m.graph("fp16")
    assert fp16.fused_operators["PackedMultiHeadAttention"] == m.num_layers and fp16.packed
    assert "PackedAttention" not in fp16.fused_operators
    if fp16.custom_kernels:  # library built: the Q, K, V products add the attention's bias, gated like the rest;
        # with our attention kernel they are one product a layer, read in place, and three without it
        from custom_kernels.fusion import MATMUL_BIAS, PACKED_QKV_ATTENTION

        operators = fp16.custom_kernels.operators
        products_a_layer = 1 if operators.get(PACKED_QKV_ATTENTION) == m.num_layers else 3
        assert operators[MATMUL_BIAS] == products_a_layer * m.num_layers
    tok = Tokenizer.from_file(str(tmp_path / "art" / "tokenizer.json"))
    feed = padded_feed([tok.encode("a short one"), tok.encode("a much longer sentence with more words", "and a pair")])
    want = reference_outputs(EmbeddingGraph(load_model_folder(tiny_model_dir).model, True, True), feed)
    got = dict(zip(fp16.outputs, open_session(tmp_path / "art" / fp16.file, "cuda").run(fp16.outputs, feed)))
    real = feed["attention_mask"].astype(bool)
    assert cosine(got[TOKEN_EMBEDDINGS][real], want[TOKEN_EMBEDDINGS][real]).min() >= 0.999
    assert cosine(got[CLS_EMBEDDING], want[CLS_EMBEDDING]).min() >= 0.999


@pytest.mark.slow
def test_base_sized_fp16_export(tmp_path, tiny_tokenizer_dir):
    """The production shape: 12 layers, 768 hidden, every layer's attention fused, fp16 within tolerance."""
    torch.manual_seed(0)
    model = BertForPreTraining(preset_config("base", vocab_size=30522))
    src = save_model_folder(model, tiny_tokenizer_dir, tmp_path / "base")
    m = export_artifact(src, tmp_path / "art", device="cuda")
    fp16 = m.graph("fp16")
    assert fp16.fused_operators["Attention"] + fp16.fused_operators["MultiHeadAttention"] == 12
    assert fp16.fused_operators["SkipLayerNormalization"] == 24
    assert fp16.parity["cls_embedding_min_cosine"] >= 0.999


@pytest.mark.parametrize("keep_padding", [False, True])
def test_custom_kernels_graph_exported_checked_and_served(tiny_model_dir, tmp_path, keep_padding):
    """Needs custom_kernels' CUDA library (bash custom_kernels/build.sh, or $BERTSERVE_KERNELS_LIBRARY):
    `--custom-kernels on` fails the export without it."""
    from app.engine import Batch, OrtEngine
    from custom_kernels.fusion import MATMUL_BIAS, MATMUL_BIAS_GELU, PACKED_QKV_ATTENTION, REMOVE_PADDING

    out = tmp_path / "art"
    argv = ["--model", str(tiny_model_dir), "--out", str(out), "--device", "cuda", "--custom-kernels", "on"]
    assert main(argv + (["--keep-padding"] if keep_padding else [])) == 0
    m = read_manifest(out)
    kernels = m.graph("fp16").custom_kernels
    # packed (the default with the library): each layer's Q, K and V as one product with its bias, the
    # attention reading it in place, and the padding's removal, on our kernels (the library is built with
    # nvcc here)
    want_operators = {MATMUL_BIAS_GELU: m.num_layers} | ({} if keep_padding else {
        MATMUL_BIAS: m.num_layers, PACKED_QKV_ATTENTION: m.num_layers, REMOVE_PADDING: 1})
    assert kernels.operators == want_operators
    assert kernels.parity["token_embeddings_min_cosine"] >= 0.999
    assert kernels.parity["nsp_prob_max_diff"] <= 0.01

    fused = OrtEngine(out, m, "cuda", "fp16", kernels="on")
    plain = OrtEngine(out, m, "cuda", "fp16", kernels="off")
    assert fused.custom_kernels and fused.graph_file == kernels.file and not plain.custom_kernels
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    feed = padded_feed([tok.encode("a short one"),
                        tok.encode("a much longer sentence with more words in it", "and a pair")] * 9)
    batch = Batch(feed["input_ids"], feed["attention_mask"], feed["token_type_ids"],
                  (TOKEN_EMBEDDINGS, CLS_EMBEDDING, POOLED_EMBEDDING))
    got, want = fused.run(batch), plain.run(batch)
    real = feed["attention_mask"].astype(bool)
    assert cosine(got[TOKEN_EMBEDDINGS][real], want[TOKEN_EMBEDDINGS][real]).min() >= 0.9999
    assert cosine(got[CLS_EMBEDDING], want[CLS_EMBEDDING]).min() >= 0.9999
    assert cosine(got[POOLED_EMBEDDING], want[POOLED_EMBEDDING]).min() >= 0.9999


def test_no_attention_kernel_keeps_onnx_runtimes_attention_in_the_kernels_graph(tiny_model_dir, tmp_path):
    """`--no-attention-kernel`: the same kernels graph, with PackedMultiHeadAttention where PackedAttention
    would be (the escape hatch, and the A/B of the two attentions through HTTP), gated like the other."""
    import onnx

    from custom_kernels.fusion import MATMUL_BIAS, PACKED_ATTENTION

    out = tmp_path / "art"
    argv = ["--model", str(tiny_model_dir), "--out", str(out), "--device", "cuda", "--custom-kernels", "on"]
    assert main(argv + ["--no-attention-kernel"]) == 0
    m = read_manifest(out)
    kernels = m.graph("fp16").custom_kernels
    assert PACKED_ATTENTION not in kernels.operators and kernels.operators[MATMUL_BIAS] == 3 * m.num_layers
    ops = [n.op_type for n in onnx.load(str(out / kernels.file), load_external_data=False).graph.node]
    assert ops.count("PackedMultiHeadAttention") == m.num_layers and PACKED_ATTENTION not in ops
    assert kernels.parity["token_embeddings_min_cosine"] >= 0.999


def test_kernels_autotuned_on_a_large_batch_give_what_cublaslts_first_choice_gives(tiny_model_dir, tmp_path,
                                                                                    monkeypatch):
    """A batch of more than 4096 tokens: the operator times cuBLASLt's candidates and keeps the fastest
    (BERTSERVE_KERNELS_AUTOTUNE=0 keeps the heuristic's first); both agree with the graph without our kernels,
    and so does a batch of another token count in the same power of two, which reuses the kept choice."""
    from app.engine import Batch, OrtEngine

    out = tmp_path / "art"
    assert main(["--model", str(tiny_model_dir), "--out", str(out), "--device", "cuda", "--custom-kernels", "on"]) == 0
    m = read_manifest(out)
    tuned = OrtEngine(out, m, "cuda", "fp16", kernels="on")
    monkeypatch.setenv("BERTSERVE_KERNELS_AUTOTUNE", "0")  # read when a session's kernels are made
    first_choice = OrtEngine(out, m, "cuda", "fp16", kernels="on")
    monkeypatch.delenv("BERTSERVE_KERNELS_AUTOTUNE")
    plain = OrtEngine(out, m, "cuda", "fp16", kernels="off")
    rng = np.random.default_rng(0)
    ids = rng.integers(5, m.vocab_size, (80, 96)).astype(np.int64)
    masks = [(np.arange(96) < rng.integers(40, 97, (80, 1))).astype(np.int64) for _ in range(2)]
    assert 4096 < masks[0].sum() < 8192 and 4096 < masks[1].sum() < 8192 and masks[0].sum() != masks[1].sum()
    # tuned, untuned, the same batch again (the plan made for it), another token count (the bucket's choice)
    for engine, mask in ((tuned, masks[0]), (first_choice, masks[0]), (tuned, masks[0]), (tuned, masks[1])):
        batch = Batch(ids, mask, np.zeros_like(ids), (TOKEN_EMBEDDINGS, CLS_EMBEDDING))
        got, want = engine.run(batch), plain.run(batch)
        real = mask.astype(bool)
        assert cosine(got[TOKEN_EMBEDDINGS][real], want[TOKEN_EMBEDDINGS][real]).min() >= 0.9999
        assert cosine(got[CLS_EMBEDDING], want[CLS_EMBEDDING]).min() >= 0.9999


_START_AND_RUN = """
import sys
import numpy as np
from app.batcher import Sequences, collate
from app.build import build_engine, load_tokenizer
from app.metrics import Metrics
from app.settings import Settings
settings = Settings(model_dir=sys.argv[1], device="cuda", custom_kernels="on")
manifest, tokenizer = load_tokenizer(settings)
engine, batcher = build_engine(settings, manifest, tokenizer, Metrics())
print("STARTED", file=sys.stderr, flush=True)
lengths = np.full(60, 80) - np.arange(60) % 7  # 4,620 tokens: the 4,096-8,191 power of two
ids = np.full(int(lengths.sum()), 7, np.int64)
out = engine.run(collate(Sequences(ids, np.zeros_like(ids), lengths), engine.pad_id, frozenset({"cls_embedding"})))
assert np.isfinite(out["cls_embedding"]).all() and len(out["cls_embedding"]) == 60
"""


def test_start_up_tunes_the_kernels_for_every_large_batch_the_batcher_can_form(tiny_model_dir, tmp_path):
    """The operator tunes cuBLASLt's algorithm the first time it meets a product of 4,096 rows or more in
    each power of two of rows (50-100 ms on BERT-base): the engine's start-up runs a batch in each of them
    up to the batch budget, so no request meets that pause. In a fresh process, with the tuning logged:
    every tuning is done before the engine is ready, in each power of two from 4,096 to the budget's, and
    a batch of 4,620 tokens afterwards tunes nothing."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "art"
    assert main(["--model", str(tiny_model_dir), "--out", str(out), "--device", "cuda", "--custom-kernels", "on"]) == 0
    env = {**os.environ, "BERTSERVE_KERNELS_AUTOTUNE_LOG": "1", "BERTSERVE_MAX_BATCH_TOKENS": "16384"}
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", _START_AND_RUN, str(out)], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    before, marker, after = done.stderr.partition("STARTED")
    assert marker, done.stderr[-3000:]
    tuned_rows = {int(m) for m in re.findall(r"bertserve autotune \S+ M=(\d+)", before)}
    assert {rows.bit_length() - 1 for rows in tuned_rows} == {12, 13, 14}, before[-3000:]
    assert "bertserve autotune" not in after, after


def test_kernels_reuse_a_buckets_algorithm_for_new_token_counts(tiny_model_dir, tmp_path):
    """The packed graph's products have as many rows as the batch has real tokens, so most batches bring
    a row count the process has not met: the operator takes the algorithm chosen for its power of two of
    rows instead of querying cuBLASLt again. Batches of 1 to about 3,000 tokens, each of a new count,
    several in every power of two, agree with the graph without our kernels."""
    from app.engine import Batch, OrtEngine

    out = tmp_path / "art"
    assert main(["--model", str(tiny_model_dir), "--out", str(out), "--device", "cuda", "--custom-kernels", "on"]) == 0
    m = read_manifest(out)
    fused = OrtEngine(out, m, "cuda", "fp16", kernels="on", cuda_graphs="off")
    plain = OrtEngine(out, m, "cuda", "fp16", kernels="off", cuda_graphs="off")
    rng = np.random.default_rng(1)
    seen = set()
    for rows in (1, 1, 2, 3, 5, 8, 8, 13, 21, 21, 34, 34, 55, 55, 55):
        lengths = rng.integers(1, 61, rows)
        if lengths.sum() in seen:
            continue
        seen.add(lengths.sum())
        mask = (np.arange(lengths.max())[None, :] < lengths[:, None]).astype(np.int64)
        ids = np.where(mask == 1, rng.integers(5, m.vocab_size, mask.shape),
                       m.special_tokens.get("[PAD]", 0)).astype(np.int64)
        batch = Batch(ids, mask, np.zeros_like(ids), (TOKEN_EMBEDDINGS, CLS_EMBEDDING))
        got, want = fused.run(batch), plain.run(batch)
        real = mask.astype(bool)
        assert cosine(got[TOKEN_EMBEDDINGS][real], want[TOKEN_EMBEDDINGS][real]).min() >= 0.9999, lengths.sum()
        assert cosine(got[CLS_EMBEDDING], want[CLS_EMBEDDING]).min() >= 0.9999, lengths.sum()
    assert len(seen) >= 12


@pytest.mark.parametrize("kernels,keep_padding", [("off", False), ("on", False), ("on", True)])
def test_batches_replay_cuda_graphs_of_the_graph_exported_for_them(tiny_model_dir, tmp_path, kernels, keep_padding):
    """A packed fp16 graph gets a host-packed variant (and its kernels variant with the library), gated on
    parity like it; the engine replays it for every batch within its buckets that wants no token vectors,
    each replay on its own new inputs, runs it uncaptured for such a batch past its buckets, and answers
    what the packed graph answers. A padded graph is replayed as it is, for small batches. The rest runs on
    the session's graph."""
    from app.engine import Batch, OrtEngine
    from artifact.manifest import HOST_PACKED_GRAPH_FILE, HOST_PACKED_KERNELS_GRAPH_FILE, MEAN_EMBEDDING, NSP_LOGITS

    out = tmp_path / "art"  # written by default on CUDA
    assert main(["--model", str(tiny_model_dir), "--out", str(out), "--device", "cuda", "--custom-kernels", kernels]
                + (["--keep-padding"] if keep_padding else [])) == 0
    m = read_manifest(out)
    fp16 = m.graph("fp16")
    if keep_padding:
        assert fp16.padded.file == GRAPH_FILES["fp16"] and fp16.host_packed is None
    else:
        host_packed = fp16.host_packed
        assert fp16.padded is None and host_packed.file == HOST_PACKED_GRAPH_FILE
        # this model pools by [CLS]: its replays leave the mean out (the packed graph answers it)
        assert host_packed.outputs == [name for name in fp16.outputs if name not in (TOKEN_EMBEDDINGS, MEAN_EMBEDDING)]
        assert host_packed.parity["cls_embedding_min_cosine"] >= 0.999 and host_packed.parity["nsp_prob_max_diff"] <= 0.01
        assert (host_packed.custom_kernels.file if kernels == "on" else None) == (
            HOST_PACKED_KERNELS_GRAPH_FILE if kernels == "on" else host_packed.custom_kernels)
    replayed = OrtEngine(out, m, "cuda", "fp16", kernels=kernels, cuda_graphs="on", max_batch_size=24,
                         cuda_graph_tokens=2000)
    packed = OrtEngine(out, m, "cuda", "fp16", kernels=kernels, cuda_graphs="off")
    assert replayed.cuda_graphs and not packed.cuda_graphs
    assert (not replayed.packed_lanes) == keep_padding and (replayed.graph_buckets is None) != keep_padding
    replays, uncaptured = [], []
    if not keep_padding:
        lane = replayed.packed_lanes[0]
        replay, run = lane._replay, lane._run_uncaptured
        lane._replay = lambda key, lengths, *a: replays.append(len(lengths)) or replay(key, lengths, *a)
        lane._run_uncaptured = lambda lengths, *a: uncaptured.append(len(lengths)) or run(lengths, *a)

    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    rng = np.random.default_rng(0)
    words = "the a cat sat on mat of words longer sentence with more in it and pair".split()
    texts = [tok.encode(" ".join(rng.choice(words, int(n)))) for n in rng.integers(1, 120, 60)]
    texts[0] = tok.encode(" ".join(["word"] * 200))  # the longest the model takes, once truncated
    for text in texts:
        text.truncate(m.max_length)
    assert len(texts[0]) == m.max_length
    per_row = (CLS_EMBEDDING, POOLED_EMBEDDING, NSP_LOGITS)
    cases = [(rows, first, per_row) for rows, first in [(1, 1), (1, 0), (3, 5), (4, 2), (5, 9), (16, 20), (17, 30),
                                                         (24, 3), (25, 0)]]
    cases += [(3, 5, per_row + (TOKEN_EMBEDDINGS, MEAN_EMBEDDING)), (2, 7, (CLS_EMBEDDING,)), (4, 1, (MEAN_EMBEDDING,))]
    for rows, first, outputs in cases:
        feed = padded_feed([texts[(first + i) % len(texts)] for i in range(rows)])
        batch = Batch(feed["input_ids"], feed["attention_mask"], feed["token_type_ids"], outputs)
        got, want = replayed.run(batch), packed.run(batch)
        assert {k: v.shape for k, v in got.items()} == {k: v.shape for k, v in want.items()}
        if TOKEN_EMBEDDINGS in outputs:
            real = feed["attention_mask"].astype(bool)
            assert cosine(got[TOKEN_EMBEDDINGS][real], want[TOKEN_EMBEDDINGS][real]).min() >= 0.9999, (rows, first)
            # each row's mean is over its own real tokens
            mean = (want[TOKEN_EMBEDDINGS] * real[..., None]).sum(1) / real.sum(1, keepdims=True)
            assert cosine(got[MEAN_EMBEDDING], mean).min() >= 0.9999, (rows, first)
        if MEAN_EMBEDDING in outputs:
            assert cosine(got[MEAN_EMBEDDING], want[MEAN_EMBEDDING]).min() >= 0.9999, (rows, first)
        if CLS_EMBEDDING in outputs:
            assert cosine(got[CLS_EMBEDDING], want[CLS_EMBEDDING]).min() >= 0.9999, (rows, first)
        if POOLED_EMBEDDING in outputs:
            assert cosine(got[POOLED_EMBEDDING], want[POOLED_EMBEDDING]).min() >= 0.9999, (rows, first)
            np.testing.assert_allclose(got[NSP_LOGITS], want[NSP_LOGITS], atol=2e-2)
    if not keep_padding:  # without token vectors: replayed within 24 rows and 2000 tokens, else uncaptured
        tokens = [sum(len(texts[(first + i) % len(texts)]) for i in range(rows)) for rows, first, _ in cases]
        per_row_cases = [(rows, n) for (rows, _, outputs), n in zip(cases, tokens)
                         if not {TOKEN_EMBEDDINGS, MEAN_EMBEDDING} & set(outputs)]
        assert replays == [rows for rows, n in per_row_cases if rows <= 24 and n <= 2000]
        assert uncaptured == [rows for rows, n in per_row_cases if rows > 24 or n > 2000] and uncaptured
        assert len(set(replays)) >= 5


def test_a_small_batch_replays_a_cuda_graph_only_when_the_gpu_is_otherwise_idle(tiny_model_dir, tmp_path, monkeypatch):
    """A padded graph's CUDA graphs: beside a running batch a small one runs on the session's graph (a
    replay's synchronous copies would wait for the other batch), with the same answer; alone it replays."""
    import threading

    from app.engine import Batch, OrtEngine

    out = tmp_path / "art"
    assert main(["--model", str(tiny_model_dir), "--out", str(out), "--device", "cuda", "--keep-padding"]) == 0
    engine = OrtEngine(out, read_manifest(out), "cuda", "fp16")
    assert engine.cuda_graphs
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))

    def batch(rows: int) -> Batch:
        feed = padded_feed([tok.encode("a text of a few words")] * rows)
        return Batch(feed["input_ids"], feed["attention_mask"], feed["token_type_ids"], (CLS_EMBEDDING,))

    replays, entered, release = [], threading.Event(), threading.Event()
    replay, session = engine.graph_buckets.run, engine._run_session

    def held_session(b: Batch):
        if len(b.input_ids) == 64:  # the large batch stays on the GPU until released
            entered.set()
            release.wait(10)
        return session(b)

    monkeypatch.setattr(engine.graph_buckets, "run", lambda *a: replays.append(a[0].shape) or replay(*a))
    monkeypatch.setattr(engine, "_run_session", held_session)
    large = threading.Thread(target=engine.run, args=(batch(64),))
    large.start()
    assert entered.wait(10)
    beside = engine.run(batch(2))[CLS_EMBEDDING]
    assert replays == []
    release.set()
    large.join(10)
    alone = engine.run(batch(2))[CLS_EMBEDDING]
    assert len(replays) == 1
    assert cosine(beside, alone).min() >= 0.9999


@pytest.mark.parametrize("keep_padding", [False, True])
def test_replays_from_any_thread_beside_running_batches_never_fail(tiny_model_dir, tmp_path, keep_padding):
    """ONNX Runtime keeps captured CUDA graphs per calling thread: replays asked for from threads other than
    the one that captured them, while other threads keep running the session's graph, all succeed (each
    would otherwise capture again, and a capture beside a running batch fails both)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from app.engine import Batch, OrtEngine

    out = tmp_path / "art"
    assert main(["--model", str(tiny_model_dir), "--out", str(out), "--device", "cuda"]
                + (["--keep-padding"] if keep_padding else [])) == 0
    engine = OrtEngine(out, read_manifest(out), "cuda", "fp16")
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    large = padded_feed([tok.encode("a longer text that keeps the session's graph busy for a while")] * 64)
    small = Batch(*(padded_feed([tok.encode("a short one")] * 3)[k] for k in INPUT_NAMES), (CLS_EMBEDDING,))

    def replay():
        if keep_padding:
            return engine.graph_buckets.run(small.input_ids, small.attention_mask, small.token_type_ids,
                                            small.outputs)[CLS_EMBEDDING]
        ids, type_ids, lengths = small.unpadded()
        return engine.packed_lanes[0].run(lengths, ids, type_ids, small.outputs)[CLS_EMBEDDING]

    want = replay()
    stop, failures = threading.Event(), []

    def keep_busy():
        batch = Batch(large["input_ids"], large["attention_mask"], large["token_type_ids"], (CLS_EMBEDDING,))
        while not stop.is_set():
            try:
                engine._run_session(batch)
            except Exception as e:  # noqa: BLE001 - reported below
                failures.append(e)
                return

    busy = [threading.Thread(target=keep_busy) for _ in range(2)]
    for t in busy:
        t.start()
    try:
        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda _: replay(), range(64)))
    finally:
        stop.set()
        for t in busy:
            t.join(30)
    assert failures == []
    assert all(cosine(g, want).min() >= 0.9999 for g in got)


def test_a_mean_pooling_models_mean_replays_from_its_packed_tokens(tiny_model_dir, tmp_path):
    """A model that pools by mean (a sentence-transformers folder, as most are) gets the mean in its
    host-packed graph too (export.mean_output), gated on parity: a mean-pooled batch within the buckets
    replays, and each row is its own real tokens' mean, in buckets with empty rows and filler tokens."""
    import json
    import shutil

    from app.engine import Batch, OrtEngine
    from artifact.manifest import MEAN_EMBEDDING

    model = tmp_path / "st"
    shutil.copytree(tiny_model_dir, model)
    (model / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (model / "1_Pooling").mkdir()
    (model / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 128,
                                                                 "pooling_mode_mean_tokens": True}))
    out = tmp_path / "art"
    assert main(["--model", str(model), "--out", str(out), "--device", "cuda"]) == 0
    m = read_manifest(out)
    host_packed = m.graph("fp16").host_packed
    assert m.default_pooling == "mean" and MEAN_EMBEDDING in host_packed.outputs
    assert host_packed.parity["mean_embedding_min_cosine"] >= 0.999
    engine = OrtEngine(out, m, "cuda", "fp16", max_batch_size=24, cuda_graph_tokens=2000)
    packed = OrtEngine(out, m, "cuda", "fp16", cuda_graphs="off")
    lane = engine.packed_lanes[0]
    replays = []
    run = lane.run
    lane.run = lambda lengths, *a: replays.append(len(lengths)) or run(lengths, *a)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    tok.enable_truncation(m.max_length)  # as the server's tokenizer: some of these texts run past it
    rng = np.random.default_rng(5)
    words = "the a cat sat on mat of words longer sentence with more in it and pair".split()
    assert not lane.takes_any_size  # as much work as the packed graph: a batch past the buckets runs there
    sizes = [1, 2, 3, 5, 9, 17, 24, 30]
    for rows in sizes:
        texts = [tok.encode(" ".join(rng.choice(words, int(n)))) for n in rng.integers(1, 60, rows)]
        feed = padded_feed(texts)
        batch = Batch(*(feed[k] for k in INPUT_NAMES), (MEAN_EMBEDDING, CLS_EMBEDDING))
        got = engine.run(batch)
        tokens = packed.run(Batch(*(feed[k] for k in INPUT_NAMES), (TOKEN_EMBEDDINGS,)))[TOKEN_EMBEDDINGS]
        real = feed["attention_mask"].astype(bool)
        mean = (tokens * real[..., None]).sum(1) / real.sum(1, keepdims=True)
        assert got[MEAN_EMBEDDING].shape == (rows, 128)
        assert cosine(got[MEAN_EMBEDDING], mean).min() >= 0.9999, rows
    assert replays == [rows for rows in sizes if rows <= 24]


def test_short_texts_replay_graphs_as_wide_as_their_longest_and_answer_as_the_packed_graph(tiny_model_dir, tmp_path):
    """cuda_graph_short_lengths 16,32: a batch whose longest text has at most 16 tokens replays a graph
    whose token offsets are 16 wide, up to 32 one 32 wide, a longer one the model's full width; each
    answers what the packed graph answers, on reused packing arrays, in any order of widths and sizes."""
    from app.engine import Batch, OrtEngine

    out = tmp_path / "art"
    assert main(["--model", str(tiny_model_dir), "--out", str(out), "--device", "cuda"]) == 0
    m = read_manifest(out)
    engine = OrtEngine(out, m, "cuda", "fp16", cuda_graph_short_lengths=(16, 32))
    packed = OrtEngine(out, m, "cuda", "fp16", cuda_graphs="off")
    lane = engine.packed_lanes[0]
    assert lane.widths == (16, 32, m.max_length)
    replayed_widths = []
    replay = lane._replay  # called with each batch's (rows, tokens, width) bucket
    lane._replay = lambda key, *a: replayed_widths.append(key[2]) or replay(key, *a)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    rng = np.random.default_rng(3)
    want_widths = []
    for rows, longest in [(1, 5), (7, 16), (3, 30), (20, 14), (2, 100), (40, 12), (1, 17), (9, 32), (5, 33), (30, 8)]:
        texts = [tok.encode(" ".join(["word"] * 300)) for _ in range(rows)]  # truncated below
        lengths = rng.integers(3, longest + 1, rows)
        lengths[rng.integers(rows)] = longest
        for text, n in zip(texts, lengths):
            text.truncate(int(n))
        feed = padded_feed(texts)
        real_longest = int(feed["attention_mask"].sum(1).max())
        want_widths.append(next(w for w in (16, 32, m.max_length) if w >= real_longest))
        batch = Batch(*(feed[k] for k in INPUT_NAMES), (CLS_EMBEDDING, POOLED_EMBEDDING))
        got, want = engine.run(batch), packed.run(batch)
        for name in batch.outputs:
            assert cosine(got[name], want[name]).min() >= 0.9999, (rows, longest, name)
    assert replayed_widths == want_widths and {16, 32, m.max_length} <= set(want_widths)


def test_two_sessions_replay_side_by_side_and_answer_as_the_packed_graph(tiny_model_dir, tmp_path):
    """cuda_graph_lanes 2: batches handed to the thread replay_thread names go to both sessions (the least
    claimed takes the next), and every answer is the packed graph's."""
    import threading

    from app.engine import Batch, OrtEngine

    out = tmp_path / "art"
    assert main(["--model", str(tiny_model_dir), "--out", str(out), "--device", "cuda"]) == 0
    m = read_manifest(out)
    engine = OrtEngine(out, m, "cuda", "fp16", cuda_graph_lanes=2)
    packed = OrtEngine(out, m, "cuda", "fp16", cuda_graphs="off")
    assert len(engine.packed_lanes) == 2
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    batches = []
    for rows in (1, 2, 5, 9, 16, 30):
        feed = padded_feed([tok.encode(" ".join(["word"] * (1 + (i * 7) % 40))) for i in range(rows)])
        batches.append(Batch(*(feed[k] for k in INPUT_NAMES), (CLS_EMBEDDING, POOLED_EMBEDDING)))
    # replay_busy: work that would replay waits in the batcher's queue only while every lane has a batch
    one, _, lengths = batches[0].unpadded()
    small = (len(lengths), int(lengths.max()), len(one), batches[0].outputs, False)
    assert not engine.replay_busy(len(one), {CLS_EMBEDDING})
    first = engine.replay_thread(*small)
    assert not engine.replay_busy(len(one), {CLS_EMBEDDING})  # the other lane is free
    second = engine.replay_thread(*small)
    assert engine.replay_busy(len(one), {CLS_EMBEDDING})
    assert engine.replay_busy(engine.packed_lanes[0].max_tokens + 1, {CLS_EMBEDDING})  # past the buckets: uncaptured there
    assert not engine.replay_busy(len(one), {TOKEN_EMBEDDINGS})
    for lane in (first, second):
        lane.submit(engine.run, batches[0]).result(30)
    assert not engine.replay_busy(len(one), {CLS_EMBEDDING})
    # replay_next: on a lane's thread `take` gets that lane's limits, and the lane stays claimed when it took
    asked = []
    assert engine.replay_next(lambda *limits: asked.append(limits) or ["batch"]) is None and asked == []
    lane = engine.packed_lanes[0]
    assert lane.thread.submit(engine.replay_next, lambda *limits: asked.append(limits) or []).result(30) is None
    assert lane.claims == 0
    assert lane.thread.submit(engine.replay_next, lambda *limits: ["batch"]).result(30) == ["batch"]
    assert asked == [(lane.max_rows, lane.max_tokens, lane.outputs)] and lane.claims == 1
    assert not engine.replay_busy(len(one), {CLS_EMBEDDING})  # the other lane is free
    lane.thread.submit(engine.run, batches[0]).result(30)  # the batch it took: its replay ends the claim
    assert lane.claims == 0
    work = []
    for batch in batches * 6:
        ids, _, lengths = batch.unpadded()
        thread = engine.replay_thread(len(lengths), int(lengths.max()), len(ids), batch.outputs, False)
        work.append((batch, thread.submit(lambda b=batch: (threading.get_ident(), engine.run(b)))))
    ran_on = set()
    for batch, future in work:
        ident, got = future.result(30)
        ran_on.add(ident)
        want = packed.run(batch)
        for name in batch.outputs:
            assert cosine(got[name], want[name]).min() >= 0.9999
    assert ran_on == {lane.thread_id for lane in engine.packed_lanes}
    assert all(lane.claims == 0 for lane in engine.packed_lanes)
