"""Small batches in fixed-shape buckets (app/cuda_graphs.py). CUDA graph capture itself needs a GPU
(tests/test_export_gpu.py); the padding into buckets and the cutting back out are checked here on the
CPU provider with the tiny artifact's fp32 graph, against the same batch run as it is."""
from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import pytest

from app.cuda_graphs import (CLS_ROWS_MAX_TOKENS, MAX_ROWS, PACKED_MAX_TOKENS, PACKED_ROWS, PACKED_SHORT_WIDTHS,
                             CudaGraphBuckets, PackedGraphBuckets, ReplayPlanner, bucket_for, default_replay_tokens,
                             packed_buckets, packed_width_buckets, rows_up_to)
import app.batcher as app_batcher
from app.batcher import DynamicBatcher, Sequences
from app.engine import Batch, EngineError, OrtEngine
from app.errors import EngineLost, InternalError
from app.settings import Settings
from artifact.host_packing import CLS_POSITIONS, HOST_PACKED_INPUTS, HostPacker, pack_on_host
from artifact.manifest import INPUT_NAMES, read_manifest
from tests.padding_reference import ort_token_offset


@pytest.fixture(scope="module")
def graph(tiny_artifact_dir):
    manifest = read_manifest(tiny_artifact_dir)
    session = ort.InferenceSession(str(tiny_artifact_dir / manifest.graph("fp32").file),
                                   providers=["CPUExecutionProvider"])
    return manifest, session


def batch(rng, rows: int, length: int, vocab: int, pad: int):
    lengths = rng.integers(2, length + 1, rows)
    lengths[0] = length  # the longest sets the batch's width, as collate does
    real = np.arange(length) < lengths[:, None]
    ids = np.where(real, rng.integers(5, vocab, (rows, length)), pad)
    types = np.where(real & (np.arange(length) >= lengths[:, None] // 2), 1, 0)
    return ids.astype(np.int64), real.astype(np.int64), types.astype(np.int64)


def assert_replayed_as_run(buckets, session, ids, mask, types):
    """Every output of the batch through the buckets, on its real tokens, as the session gives it."""
    names = tuple(o.name for o in session.get_outputs())
    got = buckets.run(ids, mask, types, names)
    want = dict(zip(names, session.run(list(names), dict(zip(INPUT_NAMES, (ids, mask, types))))))
    for name in names:
        assert got[name].shape == want[name].shape, name
        real = mask.astype(bool) if got[name].ndim == 3 else slice(None)
        np.testing.assert_allclose(got[name][real], want[name][real], atol=2e-5, err_msg=name)


@pytest.mark.parametrize("rows,length", [(1, 3), (1, 16), (2, 9), (3, 17), (5, 30), (8, 32)])
def test_a_batch_padded_into_a_bucket_gives_its_own_outputs(graph, rows, length):
    manifest, session = graph
    pad = manifest.special_tokens["[PAD]"]
    buckets = CudaGraphBuckets(session, "cpu", 0, manifest.max_length, pad, max_rows=8, lengths=(16, 32))
    assert buckets.fits(rows, length)
    ids, mask, types = batch(np.random.default_rng(rows * 100 + length), rows, length, manifest.vocab_size, pad)
    assert_replayed_as_run(buckets, session, ids, mask, types)


def test_a_batch_of_mixed_lengths_is_replayed_in_several_buckets_and_put_back_in_order(graph):
    manifest, session = graph
    pad = manifest.special_tokens["[PAD]"]
    buckets = CudaGraphBuckets(session, "cpu", 0, manifest.max_length, pad, max_rows=8, lengths=(8, 16, 32),
                               replay_cost_tokens=4)
    ids, mask, types = batch(np.random.default_rng(7), 7, 30, manifest.vocab_size, pad)
    mask[1:4, 6:] = ids[1:4, 6:] = 0  # three short rows among long ones, not next to each other
    mask[5, 6:] = ids[5, 6:] = 0
    ids[mask == 0] = pad
    plan = buckets.planner.plan(mask.sum(1))
    assert {bucket for _, _, bucket in plan} == {8, 32}
    assert_replayed_as_run(buckets, session, ids, mask, types)


@pytest.mark.parametrize("replay_cost", [0, 256, 10**9])
def test_a_replay_plan_covers_every_row_once_within_its_buckets_and_pads_no_more_than_one_bucket(replay_cost):
    rows, lengths = rows_up_to(64), (16, 32, 64, 128)
    planner = ReplayPlanner(rows, lengths, replay_cost)
    rng = np.random.default_rng(replay_cost)
    for n in list(range(1, 65)) * 3:
        real = np.clip(rng.lognormal(3.3, 0.7, n).astype(int), 2, 128)
        plan = planner.plan(real)
        taken = np.concatenate([t for t, _, _ in plan])
        assert sorted(taken.tolist()) == list(range(n))
        for t, bucket_rows, bucket_length in plan:
            assert 0 < len(t) <= bucket_rows and bucket_rows in rows and bucket_length in lengths
            assert real[t].max() <= bucket_length
        one_bucket = next(r for r in rows if r >= n) * next(L for L in lengths if L >= real.max())
        assert sum(r * L + replay_cost for _, r, L in plan) <= one_bucket + replay_cost
    if replay_cost == 10**9:  # replays so dear that the whole batch goes into one bucket
        assert len(plan) == 1


def test_a_batch_run_on_the_buckets_own_thread_replays_there(graph):
    """The batcher hands an idle small batch straight to the buckets' thread: `run` from there must replay
    in place (a hop to its own one-thread pool would wait on itself forever)."""
    manifest, session = graph
    pad = manifest.special_tokens["[PAD]"]
    buckets = CudaGraphBuckets(session, "cpu", 0, manifest.max_length, pad, max_rows=4, lengths=(16,))
    ids, mask, types = batch(np.random.default_rng(3), 3, 12, manifest.vocab_size, pad)
    names = tuple(o.name for o in session.get_outputs())
    on_thread = buckets.thread.submit(buckets.run, ids, mask, types, names).result(timeout=30)
    elsewhere = buckets.run(ids, mask, types, names)
    for name in names:
        np.testing.assert_array_equal(on_thread[name], elsewhere[name])


def test_only_batches_within_the_largest_bucket_fit(graph):
    manifest, session = graph
    buckets = CudaGraphBuckets(session, "cpu", 0, manifest.max_length, manifest.special_tokens["[PAD]"],
                               max_rows=4, lengths=(16, 32, 4096))
    assert buckets.lengths[-1] == manifest.max_length  # no bucket longer than the model takes
    assert buckets.fits(4, manifest.max_length) and not buckets.fits(5, 8)
    assert not buckets.fits(1, manifest.max_length + 1)


def test_the_captured_batch_sizes_are_powers_of_two_up_to_the_largest():
    assert rows_up_to(16) == (1, 2, 4, 8, 16) and rows_up_to(1) == (1,)
    assert rows_up_to(48) == (1, 2, 4, 8, 16, 32, 48)
    with pytest.raises(ValueError, match="at least 1 row"):
        rows_up_to(0)


def test_cuda_graphs_need_cuda_and_an_artifact_exported_for_them(tiny_artifact_dir):
    manifest = read_manifest(tiny_artifact_dir)
    engine = OrtEngine(tiny_artifact_dir, manifest, "cpu", "fp32", cuda_graphs="auto")
    assert not engine.cuda_graphs
    assert engine.replay_thread(1, 8, 8, ["cls_embedding"], True) is None  # every batch on the batcher's threads
    with pytest.raises(EngineError, match="needs CUDA and an artifact exported for them"):
        OrtEngine(tiny_artifact_dir, manifest, "cpu", "fp32", cuda_graphs="on")
    with pytest.raises(EngineError, match="auto, on or off"):
        OrtEngine(tiny_artifact_dir, manifest, "cpu", "fp32", cuda_graphs="yes")


@pytest.mark.parametrize("seed", range(6))
def test_host_packing_gives_what_ort_packs_on_the_gpu_with_filler_rows_and_tokens(seed):
    rng = np.random.default_rng(seed)
    rows, width = int(rng.integers(1, 9)), int(rng.integers(1, 40))
    lengths = rng.integers(1, width + 1, rows)
    ids, types = rng.integers(5, 100, lengths.sum()), rng.integers(0, 2, lengths.sum())
    bucket_rows, bucket_tokens = rows + int(rng.integers(0, 3)), int(lengths.sum() + rng.integers(0, 9))
    tokens, offset, cumulative, cls = pack_on_host(lengths, ids, types, bucket_rows, bucket_tokens, width, pad_id=3)
    all_lengths = list(lengths) + [0] * (bucket_rows - rows)
    want_offset, want_cumulative = ort_token_offset(all_lengths, width)
    assert offset.shape == (bucket_rows, width) and offset.ravel().tolist() == want_offset
    assert cumulative.tolist() == want_cumulative
    count = int(lengths.sum())
    assert tokens.shape == (3, bucket_tokens) and tokens.dtype == np.int32
    assert tokens[0, :count].tolist() == ids.tolist() and (tokens[0, count:] == 3).all()
    assert tokens[1, :count].tolist() == types.tolist() and (tokens[1:, count:] == 0).all()
    assert tokens[2, :count].tolist() == [p for n in lengths for p in range(n)]  # positions restart per row
    assert cls.tolist() == want_cumulative[:rows] + [0] * (bucket_rows - rows)  # filler rows read token 0


def test_a_reused_packer_gives_each_batch_what_a_fresh_one_does():
    """Batches of more rows, then fewer, then none, then more again, through one packer's arrays: the
    offsets the last batch wrote past this one's rows are filler's again."""
    rng = np.random.default_rng(7)
    rows, width, tokens = 16, 24, 200
    packer = HostPacker(rows, width)
    for n in (12, 3, 16, 0, 1, 9, 9, 2):
        lengths = rng.integers(1, width + 1, n)
        while lengths.sum() > tokens:
            lengths = lengths // 2 + 1
        ids, types = rng.integers(5, 100, lengths.sum()), rng.integers(0, 2, lengths.sum())
        got = packer.pack(lengths, ids, types, tokens, pad_id=3)
        want = pack_on_host(lengths, ids, types, rows, tokens, width, pad_id=3)
        for name, a, b in zip(("tokens", "token_offset", "cumulative", "cls"), got, want):
            assert a.shape == b.shape and a.tolist() == b.tolist(), (n, name)
        assert got[1].ravel().tolist() == ort_token_offset(list(lengths) + [0] * (rows - n), width)[0]


def test_a_packer_holds_a_buckets_four_inputs_in_one_array_at_aligned_places():
    """What a replay copies to the GPU in one copy: the flat array for a bucket of T tokens holds each input
    the packer answered at the place FlatLayout gives it, each 256 bytes aligned; buckets of more tokens,
    packed later, grow it without moving what lies before the tokens."""
    from artifact.host_packing import HOST_PACKED_INPUTS, FlatLayout

    rng = np.random.default_rng(3)
    rows, width = 16, 24
    packer = HostPacker(rows, width)
    for tokens in (64, 384, 128, 2048, 64):
        lengths = rng.integers(1, width + 1, int(rng.integers(0, rows + 1)))
        while lengths.sum() > tokens:
            lengths = lengths // 2 + 1
        ids, types = rng.integers(5, 100, lengths.sum()), rng.integers(0, 2, lengths.sum())
        arrays = packer.pack(lengths, ids, types, tokens, pad_id=3)
        flat, layout = packer.flat(tokens), FlatLayout(rows, width)
        assert flat.dtype == np.int32 and len(flat) == layout.size(tokens) and flat.flags.c_contiguous
        want = pack_on_host(lengths, ids, types, rows, tokens, width, pad_id=3)
        for name, array, expected in zip(HOST_PACKED_INPUTS, arrays, want):
            at, shape = layout.offsets(tokens)[name]
            assert at * 4 % 256 == 0 and array.shape == shape == expected.shape, name
            assert flat[at:at + array.size].tolist() == expected.ravel().tolist(), (tokens, name)
    assert [at for at, _ in FlatLayout(1, 8).offsets(5).values()] == [192, 0, 64, 128]  # tokens last


def test_host_packing_refuses_a_batch_its_bucket_cannot_hold():
    lengths = np.array([4, 6])
    for rows, tokens, width in [(1, 16, 8), (2, 9, 8), (2, 16, 5)]:
        with pytest.raises(ValueError, match="do not fit a bucket"):
            pack_on_host(lengths, None, None, rows, tokens, width, 0)


def test_packed_buckets_hold_every_batch_within_the_limits_in_the_smallest_that_fits():
    width, max_rows, max_tokens = 128, 256, 16384
    buckets = packed_buckets(max_rows, max_tokens, width)
    assert buckets == sorted(set(buckets)) and {r for r, _ in buckets} == set(PACKED_ROWS)
    assert max(t for _, t in buckets) == max_tokens
    for rows in [1, 2, 4, 5, 16, 17, 63, 64, 65, 200, 256]:
        for tokens in {rows, rows * 7, min(rows * width, max_tokens)}:
            holding = [(r, t) for r, t in buckets if r >= rows and t >= tokens]
            assert holding, (rows, tokens)
            smallest_rows = min(r for r, _ in holding)
            assert min(t for r, t in holding if r == smallest_rows) - tokens < max(64, tokens // 4)  # filler
    assert packed_buckets(8, 1000, 512)[-1] == (8, 1000)  # limits set by the server's batch limits
    assert packed_buckets(256, 10, 512) == [(4, 10), (16, 10)]  # a budget of fewer tokens than rows
    assert packed_buckets(2, 100, 8) == [(2, 64)]  # 2 rows of at most 8 tokens fit the first


def test_a_batch_replays_the_narrowest_width_with_room_and_there_the_smallest_bucket():
    widths, max_rows, max_tokens = (32, 128, 512), 256, 2048
    buckets = packed_width_buckets(max_rows, max_tokens, widths)
    for w in widths:  # at each width the buckets a server without short widths has at its own
        assert [(r, t) for r, t, w_ in buckets if w_ == w] == packed_buckets(max_rows, max_tokens, w)
    assert bucket_for(buckets, 1, 9, 9) == (4, 64, 32)
    assert bucket_for(buckets, 40, 1000, 30) == (64, 1024, 32)
    assert bucket_for(buckets, 40, 1000, 33) == (64, 1024, 128)
    assert bucket_for(buckets, 3, 600, 200) == (4, 640, 512)
    assert bucket_for(buckets, 8, 250, 32) == (16, 256, 32)
    assert bucket_for(buckets, 80, 2048, 31) == (256, 2048, 32)
    assert bucket_for(buckets, 80, 2049, 31) is None  # past the replay limit: the packed graph runs it
    assert bucket_for(buckets, 257, 300, 2) is None
    rng = np.random.default_rng(5)
    for _ in range(300):  # every batch within the limits lands where its rows, tokens and longest row fit
        rows, longest = int(rng.integers(1, 80)), int(rng.integers(1, 513))
        lengths = rng.integers(1, longest + 1, rows)
        lengths[0] = longest
        r, t, w = bucket_for(buckets, rows, int(lengths.sum()), longest) or (0, 0, 0)
        if lengths.sum() <= max_tokens:
            assert r >= rows and t >= lengths.sum() and w == min(w for w in widths if w >= longest)


def test_the_servers_cuda_graph_defaults_are_the_engines(tmp_path):
    """The settings spell their defaults as literals (they load without onnxruntime); OrtEngine's come from
    app/cuda_graphs.py. A change to one must be made to the other. cuda_graph_tokens follows the artifact:
    the batch budget where the replayed graph leaves out the mean (its last layer for the [CLS] rows only),
    4096 where it pools the mean."""
    settings = Settings(model_dir=tmp_path)
    assert settings.cuda_graph_rows == MAX_ROWS
    assert settings.cuda_graph_tokens is None
    assert default_replay_tokens(["cls_embedding", "pooled_embedding", "nsp_logits"]) == CLS_ROWS_MAX_TOKENS == 16384
    assert default_replay_tokens(["cls_embedding", "mean_embedding"]) == PACKED_MAX_TOKENS == 4096
    assert settings.replay_short_lengths == PACKED_SHORT_WIDTHS


def test_a_batch_past_every_bucket_runs_uncaptured_on_its_lanes_thread_and_a_failure_there_ends_its_claim(
        tiny_artifact_dir, monkeypatch):
    """OrtEngine with a host-packed lane (its session faked: capture needs a GPU): a batch without token
    vectors larger than every bucket is handed to the lane's thread (replay_thread claims it) and runs there
    on the same session uncaptured (gpu_graph_id -1), with its own shapes; replay_busy holds such work
    back whatever its size while the lane has a batch. An ORT error there still ends the claim, and a
    sticky CUDA error is still EngineLost. Token vectors never go to the lane. A lane whose graph pools the
    mean (as much work as the packed graph) takes only what its buckets hold."""
    class Session:  # what PackedGraphBuckets calls of a host-packed graph's session past its buckets
        fail = None

        def __init__(self):
            self.calls = []

        def get_outputs(self):
            return [SimpleNamespace(name="cls_embedding", shape=["rows", 4])]

        def run(self, names, feeds, options):
            graph_id = options.get_run_config_entry("gpu_graph_id")
            self.calls.append((threading.get_ident(), names, sorted(feeds), graph_id))
            if self.fail:
                raise RuntimeError(self.fail)
            return [np.ones((len(feeds[CLS_POSITIONS]), 4), np.float32)]

    monkeypatch.setattr(PackedGraphBuckets, "_make", lambda self, *key: None)  # nothing captured
    session = Session()
    lane = PackedGraphBuckets(session, 0, 64, 0, max_rows=4, max_tokens=64)
    # its lanes faked, as on a GPU, where no CPU [CLS]-rows graph takes [CLS] batches first
    engine = OrtEngine(tiny_artifact_dir, read_manifest(tiny_artifact_dir), "cpu", "fp32", cls_rows=False)
    engine.packed_lanes = (lane,)
    cls, vectors = frozenset({"cls_embedding"}), frozenset({"token_embeddings"})
    lengths = np.full(8, 16, np.int64)  # 8 rows, 128 tokens: past every bucket (4 rows, 64 tokens)
    assert lane.bucket(8, 128, 16) is None
    batch = Batch.of_rows(np.arange(5, 133), np.zeros(128, np.int64), lengths, 0, ("cls_embedding",))

    assert engine.replay_thread(1, 4, 4, vectors, True) is None and not engine.replay_busy(4, vectors)
    assert not engine.replay_busy(10**6, cls)
    thread = engine.replay_thread(8, 16, 128, cls, False)
    assert lane.claims == 1 and engine.replay_busy(1, cls) and engine.replay_busy(10**6, cls)
    got = thread.submit(engine.run, batch).result(30)
    assert got["cls_embedding"].shape == (8, 4) and lane.claims == 0
    assert session.calls == [(lane.thread_id, ["cls_embedding"], sorted(HOST_PACKED_INPUTS), "-1")]

    session.fail = "CUDA failure 2: out of memory ; GPU=0"  # not sticky: the batch fails, the engine lives
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.replay_thread(8, 16, 128, cls, False).submit(engine.run, batch).result(30)
    assert lane.claims == 0
    session.fail = "CUDA failure 700: an illegal memory access was encountered ; GPU=0"
    with pytest.raises(EngineLost, match="CUDA error 700"):
        engine.replay_thread(8, 16, 128, cls, False).submit(engine.run, batch).result(30)
    assert lane.claims == 0 and len(session.calls) == 3

    class MeanSession(Session):  # a host-packed graph that pools the mean: all the packed graph's work
        def get_outputs(self):
            return [SimpleNamespace(name=name, shape=["rows", 4]) for name in ("cls_embedding", "mean_embedding")]

    mean_lane = PackedGraphBuckets(MeanSession(), 0, 64, 0, max_rows=4, max_tokens=64)
    engine.packed_lanes = (mean_lane,)
    assert not mean_lane.takes_any_size
    assert engine.replay_thread(8, 16, 128, cls, False) is None and mean_lane.claims == 0  # the packed graph's
    assert engine.replay_thread(2, 16, 32, cls, False) is mean_lane.thread and mean_lane.claims == 1  # a bucket's
    assert not engine.replay_busy(128, cls) and engine.replay_busy(32, cls)


def test_a_batch_that_fails_on_a_lanes_thread_before_the_engine_still_ends_the_lanes_claim(
        tiny_artifact_dir, monkeypatch):
    """The batcher hands a batch to a lane's thread with the lane claimed (OrtEngine.replay_thread), and the
    engine's run ends the claim. When the batch fails there before it reaches the engine (building it
    raised), the batcher ends the claim through OrtEngine.replay_abandoned: the request gets the error, the
    lane is free (replay_busy no longer holds work back) and the next request runs on it."""
    class Session:  # a host-packed graph's session, run past its buckets (capture needs a GPU)
        def get_outputs(self):
            return [SimpleNamespace(name="cls_embedding", shape=["rows", 4])]

        def run(self, names, feeds, options):
            return [np.ones((len(feeds[CLS_POSITIONS]), 4), np.float32)]

    monkeypatch.setattr(PackedGraphBuckets, "_make", lambda self, *key: None)  # nothing captured
    lane = PackedGraphBuckets(Session(), 0, 64, 0, max_rows=4, max_tokens=64)
    # its lanes faked, as on a GPU, where no CPU [CLS]-rows graph takes [CLS] batches first
    engine = OrtEngine(tiny_artifact_dir, read_manifest(tiny_artifact_dir), "cpu", "fp32", cls_rows=False)
    engine.packed_lanes = (lane,)
    real_collate, failures = app_batcher.collate, [MemoryError("no room for the batch")]

    def collate(*args):
        if failures:
            raise failures.pop()
        return real_collate(*args)

    monkeypatch.setattr(app_batcher, "collate", collate)
    cls = frozenset({"cls_embedding"})
    rows = Sequences.concat([np.full(16, 5 + i, np.int64) for i in range(8)], [np.zeros(16, np.int64)] * 8)

    async def go():  # 8 rows of 16 tokens: past every bucket, so the lane runs them uncaptured
        batcher = DynamicBatcher(engine.run, pad_id=0, max_batch_tokens=1024, max_batch_size=64, max_wait_ms=0,
                                 max_queued=100, inference_workers=1, packed=True,
                                 replay_thread=engine.replay_thread, replay_busy=engine.replay_busy,
                                 replay_next=engine.replay_next, replay_abandoned=engine.replay_abandoned)
        batcher.start()
        try:
            with pytest.raises(InternalError, match=r"inference failed \(MemoryError\)"):
                await batcher.submit_group(rows, cls)
            claims_after_failure = lane.claims
            answer = await asyncio.wait_for(batcher.submit_group(rows, cls), 30)
        finally:
            await batcher.stop()
        return claims_after_failure, answer

    claims_after_failure, answer = asyncio.run(go())
    assert claims_after_failure == 0 and lane.claims == 0 and not engine.replay_busy(1, cls)
    assert answer.outputs["cls_embedding"].shape == (8, 4)


def test_a_batch_longer_than_the_models_max_length_is_refused_before_onnx_runtime(tiny_artifact_dir, monkeypatch):
    """The tokenizer truncates every text to max_length before the engine. A batch that still brings a longer
    row is refused in one line, on every device: on the CPU ORT's embedding node refuses such positions itself,
    but on a GPU it read past the position table and answered (a GPU test fed such a row unnoticed). Refused
    on a lane's thread, the batch ends the lane's claim as a run would."""
    m = read_manifest(tiny_artifact_dir)
    engine = OrtEngine(tiny_artifact_dir, m, "cpu", "fp32", cls_rows=False)  # lanes faked below, as on a GPU
    monkeypatch.setattr(PackedGraphBuckets, "_make", lambda self, *key: None)  # nothing captured
    session = SimpleNamespace(get_outputs=lambda: [SimpleNamespace(name="cls_embedding", shape=["rows", 4])])
    lane = PackedGraphBuckets(session, 0, 64, 0, max_rows=4, max_tokens=64)
    engine.packed_lanes = (lane,)
    cls = frozenset({"cls_embedding"})
    too_long = np.full((1, m.max_length + 1), 7, np.int64)
    on_lane = engine.replay_thread(1, m.max_length + 1, m.max_length + 1, cls, True)
    assert on_lane is lane.thread and lane.claims == 1
    with pytest.raises(ValueError, match="more than the model's max_length"):
        on_lane.submit(engine.run, Batch(too_long, np.ones_like(too_long), np.zeros_like(too_long),
                                         ("cls_embedding",))).result(30)
    assert lane.claims == 0
    engine.packed_lanes = ()
    for width in (m.max_length, m.max_length + 1):
        ids = np.full((2, width), 7, np.int64)
        batch = Batch(ids, np.ones_like(ids), np.zeros_like(ids), ("cls_embedding",))
        if width > m.max_length:
            with pytest.raises(ValueError, match=f"{width} tokens, more than the model's max_length {m.max_length}"):
                engine.run(batch)
        else:
            assert engine.run(batch)["cls_embedding"].shape == (2, m.hidden_size)
