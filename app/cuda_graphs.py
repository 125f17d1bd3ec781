"""Batches replayed as CUDA graphs (`python -m export --device cuda` writes the graph they need).

A batch of a few short texts costs ONNX Runtime about as much CPU time as a large one: it launches
every kernel of the graph one by one, from a thread that has often just woken up. A replayed CUDA graph
launches them all at once (what that saves: bench/engine_idle_gaps.py, bench/packed_cuda_graphs.py,
BENCHMARKS.md). A CUDA graph needs fixed shapes and fixed addresses, each captured graph has its own input
and output buffers on the device, and a batch is padded up to the smallest bucket that holds it:
- A packed graph's shapes follow its data (ORT removes the padding on the GPU and sizes its tensors by
  the count), so the server replays its host-packed variant instead: the tokens are packed here, one
  (rows, tokens) bucket per graph, and every batch that fits and needs no token vectors replays; where that
  graph leaves out the mean, one larger than every bucket runs on the same session uncaptured
  (`PackedGraphBuckets`).
- A padded graph is captured per (rows, length) bucket, for small batches that find the GPU idle. A
  batch is cut into a few row groups by length, each replayed in its own bucket: a batch of 64 texts
  whose longest has 90 tokens would otherwise cost 64 x 128 tokens of GPU time however short the rest
  (`CudaGraphBuckets`, `ReplayPlanner`).

ONNX Runtime keeps captured graphs per calling thread (the CUDA provider's per-thread context): a graph
captured in one thread is captured again in the next, and a capture beside a running batch fails both.
So one thread of our own captures every bucket at start-up and runs every replay.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from artifact.host_packing import HOST_PACKED_INPUTS, FlatLayout, HostPacker, pack_on_host
from artifact.manifest import INPUT_NAMES, MEAN_EMBEDDING

MAX_ROWS = 16  # the largest batch captured by default; a larger batch runs on the packed graph
LENGTHS = (16, 32, 64, 128)  # sequence lengths captured (up to the model's maximum)
_RUNS_TO_CAPTURE = 3  # ORT runs a graph normally before it captures it
# What one more replay costs, in padded tokens of GPU time: BERT-base on an H100 took 0.77 ms a replay
# (the copies, and each of the graph's few hundred kernels' least time) + 0.39 us a padded token
# (bench/cuda_graph_replays.py): a batch is split only where that saves more than a replay's worth.
REPLAY_COST_TOKENS = 1900


def rows_up_to(max_rows: int) -> tuple[int, ...]:
    """Batch sizes captured: the powers of two below `max_rows`, then `max_rows`."""
    if max_rows < 1:
        raise ValueError(f"CUDA graphs need at least 1 row, not {max_rows}")
    return tuple(1 << i for i in range(max_rows.bit_length()) if 1 << i < max_rows) + (max_rows,)


class ReplayPlanner:
    """Which rows of a batch go into which bucket: the fewest padded tokens, counting REPLAY_COST_TOKENS
    for each replay. Rows sorted longest first fall into runs by length bucket; neighbouring runs may share
    a replay (at the longer one's length), and a run may take several replays of fewer rows each (33 rows
    as 32 + 1, not 64). Cheap enough to plan every batch: the row splits are worked out once here."""

    def __init__(self, rows: tuple[int, ...], lengths: tuple[int, ...], replay_cost: int = REPLAY_COST_TOKENS):
        self.rows, self.lengths, self.replay_cost = rows, lengths, replay_cost
        # splits[k][j]: (cost, row buckets) of k rows at length bucket j, for k up to the largest bucket
        self._splits = [[(0, ())] * len(lengths)]
        for k in range(1, rows[-1] + 1):
            up = next(r for r in rows if r >= k)
            down = max((r for r in rows if r <= k), default=up)
            per_length = []
            for length in lengths:
                best = (up * length + replay_cost, (up,))
                if down < k:
                    cost, buckets = self._splits[k - down][len(per_length)]
                    if down * length + replay_cost + cost < best[0]:
                        best = (down * length + replay_cost + cost, (down,) + buckets)
                per_length.append(best)
            self._splits.append(per_length)

    def plan(self, lengths: np.ndarray) -> list[tuple[np.ndarray, int, int]]:
        """(row indices, bucket rows, bucket length) for each replay of a batch whose rows have these real
        lengths (each at most the largest bucket's, the batch at most the largest bucket's rows)."""
        order = np.argsort(-lengths, kind="stable")
        bucket_of = np.searchsorted(self.lengths, lengths[order])  # length bucket index, longest first
        # runs: (first position in `order`, row count, length bucket index), longest first
        starts = np.flatnonzero(np.r_[True, bucket_of[1:] != bucket_of[:-1]])
        runs = [(int(a), int(b - a), int(bucket_of[a])) for a, b in zip(starts, np.r_[starts[1:], len(order)])]
        # best[i]: (cost, replays) for runs[i:]; the replay that starts at run i spans runs i..j-1
        best: list[tuple[int, list]] = [(0, [])] * (len(runs) + 1)
        for i in range(len(runs) - 1, -1, -1):
            options = []
            for j in range(i + 1, len(runs) + 1):
                count = sum(n for _, n, _ in runs[i:j])
                if count > self.rows[-1]:
                    break
                cost, buckets = self._splits[count][runs[i][2]]
                options.append((cost + best[j][0], [(runs[i][0], count, runs[i][2], buckets)] + best[j][1]))
            best[i] = min(options, key=lambda option: option[0])  # never empty: a run has at most the batch's rows
        replays = []
        for first, count, length_index, buckets in best[0][1]:
            for rows in buckets:
                taken = order[first:first + min(rows, count)]
                replays.append((taken, rows, self.lengths[length_index]))
                first, count = first + len(taken), count - len(taken)
        return replays


@dataclass
class _Bucket:
    rows: int
    length: int  # padded buckets: the sequence length; host-packed buckets: the token count
    binding: ort.IOBinding
    inputs: dict[str, ort.OrtValue]
    outputs: dict[str, ort.OrtValue]
    run_options: ort.RunOptions


class _SessionThread:
    """The one thread that calls a CUDA-graph session (ORT keeps captured graphs per calling thread): work
    submitted to `thread` runs there, and `_on_thread` calls straight in when already there."""

    def __init__(self) -> None:
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="cuda-graphs")
        self._thread_id = self._thread.submit(threading.get_ident).result()

    @property
    def thread(self) -> Executor:
        """The session's own thread: work submitted here replays without a hop to it."""
        return self._thread

    @property
    def thread_id(self) -> int:
        """The ident of that thread (OrtEngine finds the lane a batch runs on by it)."""
        return self._thread_id

    def _on_thread(self, fn, *args):
        """fn(*args) on the session's thread: called straight when this is it, else handed to it and waited for."""
        if threading.get_ident() == self._thread_id:
            return fn(*args)
        return self._thread.submit(fn, *args).result()


class CudaGraphBuckets(_SessionThread):
    """`session` over a padded graph (created with the CUDA provider's enable_cuda_graph), over fixed-shape
    (rows, length) buckets. `run` takes the batch's padded int64 arrays and answers float32 outputs cut back to the
    batch's own rows and length. One batch at a time, on the buckets' own thread."""

    def __init__(self, session: ort.InferenceSession, device: str, device_id: int, max_length: int, pad_id: int,
                 max_rows: int = MAX_ROWS, lengths: tuple[int, ...] | None = None,
                 replay_cost_tokens: int = REPLAY_COST_TOKENS):
        super().__init__()
        self.session, self.device, self.device_id, self.pad_id = session, device, device_id, pad_id
        self.rows = rows_up_to(max_rows)
        self.lengths = tuple(sorted({min(n, max_length) for n in lengths or LENGTHS}))
        self.planner = ReplayPlanner(self.rows, self.lengths, replay_cost_tokens)
        self._buckets: dict[tuple[int, int], _Bucket] = {}
        for r in self.rows:
            for n in self.lengths:
                self._buckets[r, n] = self._make(r, n, len(self._buckets))

    def _make(self, rows: int, length: int, graph_id: int) -> _Bucket:
        binding = self.session.io_binding()
        inputs = {}
        for name in INPUT_NAMES:
            inputs[name] = ort.OrtValue.ortvalue_from_numpy(np.zeros((rows, length), np.int64), self.device,
                                                            self.device_id)
            binding.bind_ortvalue_input(name, inputs[name])
        outputs = {}
        for o in self.session.get_outputs():
            shape = [rows if d == "batch" else length if d == "sequence" else d for d in o.shape]
            outputs[o.name] = ort.OrtValue.ortvalue_from_shape_and_type(shape, np.float32, self.device,
                                                                        self.device_id)
            binding.bind_ortvalue_output(o.name, outputs[o.name])
        run_options = ort.RunOptions()
        if self.device == "cuda":
            run_options.add_run_config_entry("gpu_graph_id", str(graph_id))
        return _Bucket(rows, length, binding, inputs, outputs, run_options)

    def capture(self) -> None:
        """Run every bucket until ORT has captured its graph (start-up: later runs only replay)."""
        for bucket in self._buckets.values():
            ids = np.full((bucket.rows, bucket.length), self.pad_id, np.int64)
            for _ in range(_RUNS_TO_CAPTURE):
                self._on_thread(self._run, bucket, ids, np.ones_like(ids), np.zeros_like(ids), ())

    def fits(self, rows: int, length: int) -> bool:
        return rows <= self.rows[-1] and length <= self.lengths[-1]

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, token_type_ids: np.ndarray,
            outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        replays = self.planner.plan(attention_mask.sum(1))
        return self._on_thread(self._replay, replays, input_ids, attention_mask, token_type_ids, outputs)

    def _replay(self, replays: list[tuple[np.ndarray, int, int]], input_ids: np.ndarray, attention_mask: np.ndarray,
                token_type_ids: np.ndarray, outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        """Each replay's rows padded into its bucket, run, and put back in their places in the batch."""
        rows, length = input_ids.shape
        answer: dict[str, np.ndarray] = {}
        for taken, bucket_rows, bucket_length in replays:
            n, width = len(taken), min(length, bucket_length)  # the rows' real tokens all lie within `width`
            ids = np.full((bucket_rows, bucket_length), self.pad_id, np.int64)
            mask, types = np.zeros_like(ids), np.zeros_like(ids)
            ids[:n, :width] = input_ids[taken, :width]
            mask[:n, :width] = attention_mask[taken, :width]
            types[:n, :width] = token_type_ids[taken, :width]
            mask[n:, 0] = 1  # rows that only fill the bucket attend to one token: no empty softmax
            values = self._run(self._buckets[bucket_rows, bucket_length], ids, mask, types, outputs)
            for name, value in values.items():
                if name not in answer:  # token vectors past a row's bucket are padding, left at zero
                    answer[name] = np.zeros((rows, length) + value.shape[2:] if value.ndim == 3
                                            else (rows,) + value.shape[1:], value.dtype)
                if value.ndim == 3:
                    answer[name][taken, :width] = value[:n, :width]
                else:
                    answer[name][taken] = value[:n]
        return answer

    def _run(self, bucket: _Bucket, ids: np.ndarray, mask: np.ndarray, types: np.ndarray,
             outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        for name, value in zip(INPUT_NAMES, (ids, mask, types)):
            bucket.inputs[name].update_inplace(value)
        self.session.run_with_iobinding(bucket.binding, bucket.run_options)
        return {name: bucket.outputs[name].numpy() for name in outputs}  # copies to the host


# Host-packed graphs (artifact/host_packing.py): a batch's real tokens one after another, so a bucket is
# (rows, tokens) and a replay computes only its bucket's filler beyond the batch's own tokens.
FLAT_INPUTS = "flat"  # a host-packed bucket's one device array that holds its four inputs
PACKED_ROWS = (4, 16, 64, 256)
# About 1.25x apart (the filler a batch can cost)
PACKED_TOKENS = (64, 128, 192, 256, 320, 384, 512, 640, 768, 1024, 1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096,
                 5120, 6144, 7168, 8192, 10240, 12288, 14336, 16384, 20480, 24576, 28672, 32768)
# The largest batch replayed by default where the host-packed graph does as much work as the packed graph
# (its mean pools every row of the last layer): past it, batches run on the packed graph, two at a time. BERT-base
# on an H200 (bench/packed_cuda_graphs.py): a replay took 1.15 against 1.40 ms at 1,131 tokens and 2.29 against
# 2.42 ms at 3,494; past 2,048 tokens one-text HTTP traffic gained 14%. all-MiniLM-L6-v2 (mean) replaying up to
# 16,384 tokens on one lane: 64 texts a request 7.5% slower than this (BENCHMARKS.md).
PACKED_MAX_TOKENS = 4096
# Where the host-packed graph does less (its last layer for the [CLS] rows only, export/last_layer_rows.py): every
# batch the server forms replays (the GPU's batch budget), and a larger one runs there uncaptured. BERT-base [CLS]
# on an H200 through HTTP: one text a request 39.5k requests/s against 34.2k at 4,096 (BENCHMARKS.md).
CLS_ROWS_MAX_TOKENS = 16384


def does_less_than_packed(host_packed_outputs: Iterable[str]) -> bool:
    """Whether a host-packed graph with these outputs does less than the packed graph: without the mean, which
    pools every row of the last layer, export ran that layer for the [CLS] rows only."""
    return MEAN_EMBEDDING not in host_packed_outputs


def default_replay_tokens(host_packed_outputs: Iterable[str]) -> int:
    """cuda_graph_tokens' default for a host-packed graph with these outputs (see the two limits above)."""
    return CLS_ROWS_MAX_TOKENS if does_less_than_packed(host_packed_outputs) else PACKED_MAX_TOKENS


# Widths captured besides the model's longest (cuda_graph_short_lengths). On an H200 a batch of texts of at most
# 64 tokens replayed at width 64 took 0.99 against 1.04 ms at 40 texts and 1.95 against 2.14 ms at 128
# (device time); one-text HTTP traffic +8% (BENCHMARKS.md).
PACKED_SHORT_WIDTHS = (64, 128)


def packed_buckets(max_rows: int, max_tokens: int, width: int) -> list[tuple[int, int]]:
    """(rows, tokens) buckets for batches of up to `max_rows` rows of up to `width` tokens and `max_tokens`
    tokens in all: for each row bucket, the token buckets above the row bucket below it (a row has at
    least one token) up to the first that holds rows x width tokens."""
    rows = [r for r in PACKED_ROWS if r < max_rows] + [max_rows]
    tokens = [t for t in PACKED_TOKENS if t < max_tokens] + [max_tokens]
    buckets, below = [], 0
    for r in rows:
        fits = [t for t in tokens if t > below]
        if not fits:  # more rows than tokens: no batch needs them
            break
        most = next((t for t in fits if t >= r * width), fits[-1])
        buckets += [(r, t) for t in fits if t <= most]
        below = r
    return buckets


def packed_width_buckets(max_rows: int, max_tokens: int, widths: Iterable[int]) -> list[tuple[int, int, int]]:
    """(rows, tokens, width) buckets: `packed_buckets` at each width, narrowest width first (see
    `bucket_for`)."""
    return [(r, t, w) for w in sorted(set(widths)) for r, t in packed_buckets(max_rows, max_tokens, w)]


def bucket_for(buckets: list[tuple[int, int, int]], rows: int, tokens: int,
               longest: int) -> tuple[int, int, int] | None:
    """The bucket of `packed_width_buckets` a batch replays: the first that holds its rows, its tokens and
    its longest row, so of the narrowest width that has room, the smallest; None when none does."""
    return next(((r, t, w) for r, t, w in buckets if r >= rows and t >= tokens and w >= longest), None)


class PackedGraphBuckets(_SessionThread):
    """`session` over a host-packed graph (created with the CUDA provider's enable_cuda_graph), captured at
    start-up for every (rows, tokens) bucket of `packed_buckets`, at the model's maximum length and at each
    of `short_widths` (token_offset's width, which ORT's attention takes for the sequence length: a batch of
    short texts replays a graph whose attention spans only them, and packs and copies fewer offsets). `run`
    packs a batch's tokens on the host into the smallest bucket that holds them and answers its per-row
    outputs (float32); with `takes_any_size`, a batch larger than every bucket runs on the same session
    uncaptured, at its own shapes. One batch at a time, on the buckets' own thread, like CudaGraphBuckets; the
    bucket's device buffers are reused."""

    def __init__(self, session: ort.InferenceSession, device_id: int, width: int, pad_id: int, max_rows: int,
                 max_tokens: int, short_widths: Iterable[int] = ()):
        super().__init__()
        self.session, self.device_id, self.pad_id = session, device_id, pad_id
        self.width = width  # the longest row: the model's max length
        self.widths = tuple(sorted({w for w in short_widths if 0 < w < width} | {width}))
        self.outputs = frozenset(o.name for o in session.get_outputs())
        self.buckets = packed_width_buckets(max_rows, max_tokens, self.widths)
        self.max_tokens = max(t for _, t, _ in self.buckets)  # the largest batch it replays, in tokens
        self.max_rows = max(r for r, _, _ in self.buckets)  # and in rows
        self._graphs = {key: self._make(*key, graph_id) for graph_id, key in enumerate(self.buckets)}
        self._packers = {(r, w): HostPacker(r, w) for r, _, w in self.buckets}  # used on this thread only
        self._uncaptured = ort.RunOptions()  # a batch larger than every bucket runs without capture or replay
        self._uncaptured.add_run_config_entry("gpu_graph_id", "-1")
        self._claims = 0  # batches handed to this thread by `claim` and not finished
        self._claims_lock = threading.Lock()

    def _make(self, rows: int, tokens: int, width: int, graph_id: int) -> _Bucket:
        """The bucket's buffers: its four inputs in one device array, laid out as its packer's (FlatLayout),
        so that a batch goes to the GPU in one copy; each input bound where it lies in that array."""
        binding = self.session.io_binding()
        layout = FlatLayout(rows, width)
        flat = ort.OrtValue.ortvalue_from_numpy(np.zeros(layout.size(tokens), np.int32), "cuda", self.device_id)
        for name, (at, shape) in layout.offsets(tokens).items():
            binding.bind_input(name, "cuda", self.device_id, np.int32, list(shape), flat.data_ptr() + 4 * at)
        inputs = {FLAT_INPUTS: flat}
        outputs = {}
        for o in self.session.get_outputs():
            outputs[o.name] = ort.OrtValue.ortvalue_from_shape_and_type([rows, *o.shape[1:]], np.float32, "cuda",
                                                                        self.device_id)
            binding.bind_ortvalue_output(o.name, outputs[o.name])
        run_options = ort.RunOptions()
        run_options.add_run_config_entry("gpu_graph_id", str(graph_id))
        return _Bucket(rows, tokens, binding, inputs, outputs, run_options)

    def claim(self) -> Executor:
        """The thread, counting one more batch for it until its run ends (see `claims`)."""
        with self._claims_lock:
            self._claims += 1
        return self._thread

    def release(self) -> None:
        """One claimed batch fewer: its run ended (OrtEngine.run, however it ended), it failed before that
        (OrtEngine.replay_abandoned), or the claim found no batch (OrtEngine.replay_next)."""
        with self._claims_lock:
            self._claims = max(0, self._claims - 1)

    @property
    def claims(self) -> int:
        """Batches claimed and not finished: where several sessions replay, the least claimed takes the next."""
        return self._claims

    def bucket(self, rows: int, tokens: int, longest: int) -> tuple[int, int, int] | None:
        """The (rows, tokens, width) bucket such a batch replays (`bucket_for`), else None."""
        return bucket_for(self.buckets, rows, tokens, longest)

    @property
    def takes_any_size(self) -> bool:
        """Whether a batch past every bucket runs here too, uncaptured: where this graph does less than the
        packed graph (no mean, so its last layer runs for the [CLS] rows only). Where it does as much, the
        packed graph runs large batches two at a time, which this one thread cannot."""
        return does_less_than_packed(self.outputs)

    def takes(self, rows: int, longest: int, tokens: int, outputs: Iterable[str]) -> bool:
        """Whether a batch of these sizes that wants `outputs` runs here: replayed when a bucket holds it, else,
        with `takes_any_size`, run uncaptured, its shapes the batch's own (`run`)."""
        return self.outputs.issuperset(outputs) and (self.takes_any_size or
                                                      self.bucket(rows, tokens, longest) is not None)

    def capture(self) -> None:
        """Run every bucket until ORT has captured its graph (start-up: later runs only replay)."""
        for rows, tokens, width in self.buckets:
            used = min(rows, tokens)  # rows of [PAD] tokens filling the bucket as far as the width allows
            lengths = np.full(used, min(width, tokens // used), np.int64)
            for _ in range(_RUNS_TO_CAPTURE):
                self._on_thread(self._replay, (rows, tokens, width), lengths, None, None, ())

    def run(self, lengths: np.ndarray, ids: np.ndarray, type_ids: np.ndarray,
            outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        """Rows of these `lengths` whose tokens, one row after another, are `ids` / `type_ids`: replayed in the
        smallest bucket that holds them, or run uncaptured when none does (a batch larger than the buckets)."""
        key = self.bucket(len(lengths), int(lengths.sum()), int(lengths.max()))
        if key is None:
            return self._on_thread(self._run_uncaptured, lengths, ids, type_ids, outputs)
        return self._on_thread(self._replay, key, lengths, ids, type_ids, outputs)

    def _run_uncaptured(self, lengths: np.ndarray, ids: np.ndarray, type_ids: np.ndarray,
                        outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        # On this thread too: ORT runs a CUDA-graph session from one thread at a time.
        inputs = pack_on_host(lengths, ids, type_ids, len(lengths), int(lengths.sum()), int(lengths.max()),
                              self.pad_id)
        values = self.session.run(list(outputs), dict(zip(HOST_PACKED_INPUTS, inputs)), self._uncaptured)
        return dict(zip(outputs, values))

    def _replay(self, key: tuple[int, int, int], lengths: np.ndarray, ids: np.ndarray | None,
                type_ids: np.ndarray | None, outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        rows, tokens, width = key
        bucket, packer = self._graphs[key], self._packers[rows, width]
        packer.pack(lengths, ids, type_ids, tokens, self.pad_id)
        bucket.inputs[FLAT_INPUTS].update_inplace(packer.flat(tokens))
        self.session.run_with_iobinding(bucket.binding, bucket.run_options)
        return {name: bucket.outputs[name].numpy()[:len(lengths)] for name in outputs}  # copies to the host
