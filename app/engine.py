"""The ONNX Runtime backend: one session over the artifact's graph; `health()` and `run(batch)` only.

CPU runs the fp32 (or int8) graph with numpy in / out; CUDA runs the fp16 graph with IO binding and
copies back only the outputs the batch needs. Pooling, normalisation and softmax are not done here.
"""
from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from pathlib import Path
from typing import TypeVar

import numpy as np
import onnxruntime as ort

from app.cuda_graphs import (MAX_ROWS, PACKED_SHORT_WIDTHS, CudaGraphBuckets, PackedGraphBuckets,
                              default_replay_tokens)
from app.errors import EngineLost
from artifact.manifest import (CLS_EMBEDDING, INPUT_NAMES, MEAN_EMBEDDING, POOLED_EMBEDDING, TOKEN_EMBEDDINGS,
                               GraphInfo, HostPackedGraph, Manifest)
from artifact.session import CUDA, SessionError, kernels_library, open_graph, open_session

log = logging.getLogger("app.engine")
T = TypeVar("T")


class EngineError(RuntimeError):
    """The engine cannot start as configured; the message says what to change."""


class Batch:
    """The texts of one run, padded ([B, S] int64 arrays: input_ids padded with [PAD] to the longest,
    attention_mask 1 on real tokens, token_type_ids) or unpadded (ids, type_ids, lengths: the real tokens
    one row after another, as the batcher has them and host-packed graphs take them). Either form is made
    from the other when first asked for: a replayed CUDA graph never needs the padded one."""

    __slots__ = ("outputs", "_padded", "_unpadded", "_pad_id")

    def __init__(self, input_ids: np.ndarray, attention_mask: np.ndarray, token_type_ids: np.ndarray,
                 outputs: tuple[str, ...]):
        self.outputs = outputs  # graph outputs wanted by at least one entry
        self._padded = (input_ids, attention_mask, token_type_ids)
        self._unpadded: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._pad_id = None  # only a batch made of_rows pads

    @classmethod
    def of_rows(cls, ids: np.ndarray, type_ids: np.ndarray, lengths: np.ndarray, pad_id: int,
                outputs: tuple[str, ...]) -> Batch:
        batch = cls.__new__(cls)
        batch.outputs, batch._padded, batch._unpadded, batch._pad_id = outputs, None, (ids, type_ids, lengths), pad_id
        return batch

    @property
    def input_ids(self) -> np.ndarray:
        return self._padded_form()[0]

    @property
    def attention_mask(self) -> np.ndarray:
        return self._padded_form()[1]

    @property
    def token_type_ids(self) -> np.ndarray:
        return self._padded_form()[2]

    @property
    def padded_tokens(self) -> int:
        """rows x the longest row: what a padded graph computes."""
        if self._padded is not None:
            return self._padded[0].size
        lengths = self._unpadded[2]
        return len(lengths) * int(lengths.max())

    def unpadded(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if self._unpadded is None:
            input_ids, mask, type_ids = self._padded
            real = mask.astype(bool)
            self._unpadded = input_ids[real], type_ids[real], real.sum(1)
        return self._unpadded

    def _padded_form(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Padded with a few whole-array operations (not three per row)."""
        if self._padded is None:
            ids, type_ids, lengths = self._unpadded
            real = np.arange(lengths.max()) < lengths[:, None]  # [B, S] True on real tokens; filled row-major
            input_ids = np.full(real.shape, self._pad_id, dtype=np.int64)
            input_ids[real] = ids
            token_type_ids = np.zeros(real.shape, dtype=np.int64)
            token_type_ids[real] = type_ids
            self._padded = (input_ids, real.astype(np.int64), token_type_ids)
        return self._padded


# CUDA's "sticky" errors: after one, every later call in the process's CUDA context fails too
# (illegal address 700, device assert 710, hardware stack error 714, illegal instruction 715, misaligned
# address 716, invalid address space 717, invalid PC 718, launch failure 719, uncorrectable ECC 214).
STICKY_CUDA_ERRORS = frozenset({214, 700, 710, 714, 715, 716, 717, 718, 719})
_CUDA_FAILURE = re.compile(r"CUDA failure (\d+): ([^;]*)")  # as ONNX Runtime's CUDA provider words it


def device_lost(error: Exception) -> EngineLost | None:
    """EngineLost when `error` is ONNX Runtime reporting a sticky CUDA error, else None."""
    found = _CUDA_FAILURE.search(str(error))
    if found is None or int(found.group(1)) not in STICKY_CUDA_ERRORS:
        return None
    return EngineLost(f"the GPU can run nothing more in this process (CUDA error {found.group(1)}: "
                      f"{found.group(2).strip()}); the server must be restarted")


def resolve_device_precision(device: str, precision: str, manifest: Manifest,
                             providers: Sequence[str]) -> tuple[str, str]:
    """auto -> cuda when this onnxruntime has the CUDA provider (fp16 graph first), else cpu/fp32."""
    has_cuda = CUDA in providers
    if device == "auto":
        device = "cuda" if has_cuda and precision != "int8" else "cpu"
    if device == "cuda" and not has_cuda:
        raise EngineError(f"device cuda was asked for, but this onnxruntime ({ort.__version__}) has no "
                          f"CUDAExecutionProvider (providers: {', '.join(providers)}); install onnxruntime-gpu "
                          f"or use device cpu")
    if precision == "auto":
        precision = "fp16" if device == "cuda" and "fp16" in manifest.graphs else "fp32"
        if precision not in manifest.graphs and "int8" in manifest.graphs:
            # an int8-only folder (fp32 graph removed to save space) needs no re-export, only the flags; on a
            # CUDA host too, where device auto picks cuda for want of --precision int8
            on_cpu = " --device cpu" if device == "cuda" else ""
            raise EngineError(f"this artifact has no fp32 graph, only int8: serve it with --precision int8{on_cpu} "
                              f"(or re-export the model for fp32)")
    if precision == "fp16" and device != "cuda":
        raise EngineError("the fp16 graph runs on CUDA only; use precision fp32 or int8 on the CPU")
    if precision == "int8" and device != "cpu":
        raise EngineError("the int8 graph runs on the CPU only")
    manifest.graph(precision)  # raises ManifestError naming the graphs the artifact has
    return device, precision


class OrtEngine:
    def __init__(self, folder: Path, manifest: Manifest, device: str, precision: str,
                 intra_op_threads: int | None = None, cuda_device_id: int = 0, kernels: str = "auto",
                 cuda_graphs: str = "auto", cuda_graph_rows: int = MAX_ROWS, max_batch_size: int = 256,
                 cuda_graph_tokens: int | None = None, cuda_graph_lanes: int = 1,
                 cuda_graph_short_lengths: tuple[int, ...] = PACKED_SHORT_WIDTHS, cls_rows: bool = True):
        self.device, self.precision, self.cuda_device_id = device, precision, cuda_device_id
        self.intra_op_threads = intra_op_threads  # None: ONNX Runtime's choice
        graph = manifest.graph(precision)
        try:
            library = kernels_library(kernels, device)
            path, self.session = open_graph(folder, graph, device, library=library, kernels_required=kernels == "on",
                                            device_id=cuda_device_id, intra_op_threads=intra_op_threads)
        except SessionError as e:
            raise EngineError(str(e)) from e
        self.graph_file = path.name
        self.custom_kernels = path.name != graph.file
        self.provider = self.session.get_providers()[0]
        inputs = {i.name for i in self.session.get_inputs()}
        if inputs != set(INPUT_NAMES):
            raise EngineError(f"{path} has inputs {sorted(inputs)}, expected {list(INPUT_NAMES)}")
        self.outputs = frozenset(o.name for o in self.session.get_outputs())
        if not set(graph.outputs) <= self.outputs:
            raise EngineError(f"{path} lacks the outputs {sorted(set(graph.outputs) - self.outputs)} its manifest "
                              f"promises")
        self.hidden_size = manifest.hidden_size
        self.max_length = manifest.max_length  # the longest row a batch may bring (the tokenizer truncates there)
        self.packed = graph.packed  # padded tokens cost nothing: the batcher packs by tokens, not rows
        self.pad_id = manifest.special_tokens.get("[PAD]", 0)
        self.graph_buckets: CudaGraphBuckets | None = None  # a padded graph's, for small batches
        # a packed graph's host-packed variant's, one per session that replays it (each on its own thread)
        self.packed_lanes: tuple[PackedGraphBuckets, ...] = ()
        # A CPU graph's variant whose last layer runs at [CLS] only, for the batches that want only what it
        # answers (export/last_layer_rows.py), and those outputs
        self.cls_rows_session: ort.InferenceSession | None = None
        self.cls_rows_outputs: frozenset[str] = frozenset()
        if cls_rows and device == "cpu" and graph.cls_rows is not None:
            try:
                self.cls_rows_session = open_session(folder / graph.cls_rows.file, device,
                                                     intra_op_threads=intra_op_threads)
            except SessionError as e:
                raise EngineError(str(e)) from e
            self.cls_rows_outputs = frozenset(o.name for o in self.cls_rows_session.get_outputs())
            log.info("batches that need only %s run on %s (its last layer at the [CLS] position only)",
                     ", ".join(sorted(self.cls_rows_outputs)), graph.cls_rows.file)
        self._open_cuda_graphs(folder, graph, library if self.custom_kernels else None, cuda_graphs,
                               manifest.max_length, cuda_graph_rows, (max_batch_size, cuda_graph_tokens),
                               cuda_graph_lanes, cuda_graph_short_lengths)
        self._running = 0  # batches on the GPU now, from any inference thread
        self._running_lock = threading.Lock()

    @property
    def cuda_graphs(self) -> bool:
        return self.graph_buckets is not None or bool(self.packed_lanes)

    def _open_cuda_graphs(self, folder: Path, graph: GraphInfo, library: Path | None, choice: str, max_length: int,
                          max_rows: int, batch_limits: tuple[int, int | None], lanes: int,
                          short_lengths: tuple[int, ...]) -> None:
        """The artifact's graph for CUDA graphs (app/cuda_graphs.py), captured now: a packed graph's
        host-packed variant for every batch that needs no token vectors (replayed up to `batch_limits`, rows
        and tokens, the tokens None for app.cuda_graphs.default_replay_tokens; where that graph leaves out the
        mean, uncaptured past them), in `lanes` sessions that replay side by side (each also at
        `short_lengths`), or a padded graph for batches of up to `max_rows` rows that find the GPU idle. choice
        "auto": when on CUDA and the artifact has them; "on": both required; "off": never. With the custom
        kernels running (`library`), their variant."""
        if choice not in ("auto", "on", "off"):
            raise EngineError(f"cuda_graphs must be auto, on or off, not {choice!r}")
        variant = graph.host_packed or graph.padded
        if choice == "off" or (choice == "auto" and (self.device != "cuda" or variant is None)):
            return
        if self.device != "cuda" or variant is None:
            raise EngineError("cuda_graphs on needs CUDA and an artifact exported for them (python -m export "
                              "--device cuda writes what they replay unless --no-cuda-graphs)")
        packed = isinstance(variant, HostPackedGraph)
        if packed and batch_limits[1] is None:
            batch_limits = (batch_limits[0], default_replay_tokens(variant.outputs))
        captured = []
        try:
            for _ in range(lanes if packed else 1):
                path, session = open_graph(folder, variant, self.device, library=library,
                                           kernels_required=library is not None, device_id=self.cuda_device_id,
                                           cuda_graph=True, intra_op_threads=self.intra_op_threads)
                if packed:
                    buckets = PackedGraphBuckets(session, self.cuda_device_id, max_length, self.pad_id, *batch_limits,
                                                 short_widths=short_lengths)
                else:
                    buckets = CudaGraphBuckets(session, self.device, self.cuda_device_id, max_length, self.pad_id,
                                               max_rows=max_rows)
                buckets.capture()
                captured.append(buckets)
        except Exception as e:  # noqa: BLE001 - ORT raises its own types
            if choice == "on":
                raise EngineError(f"CUDA graphs of {variant.file} failed: {e}") from e
            log.warning("CUDA graphs of %s failed (%s); batches run on %s", variant.file, e, self.graph_file)
            return
        if packed:
            self.packed_lanes = tuple(captured)
            log.info("batches of up to %d texts and %d tokens replay CUDA graphs of %s (%d buckets, %d session(s))",
                     batch_limits[0], buckets.max_tokens, path.name, len(buckets.buckets), lanes)
        else:
            self.graph_buckets = buckets
            log.info("small batches (up to %d x %d tokens) replay CUDA graphs of %s", buckets.rows[-1],
                     buckets.lengths[-1], path.name)

    @property
    def warm_up_outputs(self) -> list[frozenset[str]]:
        """Outputs that send a batch to each session that may run large ones (start-up runs one of each size
        there, so that each session's memory arena has grown for it before serving; our operator's cuBLASLt
        choices are the process's, tuned by whichever session meets a size first, a lane's capture included):
        [CLS] alone, and with replaying lanes, which take [CLS] batches, token vectors too, for the session's
        own graph. With several lanes the [CLS] batches reach the first only (the least claimed); the others
        ran every size they replay when they were captured."""
        outputs = [frozenset({CLS_EMBEDDING})]
        if self.packed_lanes and TOKEN_EMBEDDINGS in self.outputs:
            outputs.append(frozenset({TOKEN_EMBEDDINGS}))
        return outputs

    def replay_thread(self, rows: int, longest: int, tokens: int, outputs: Iterable[str],
                      alone: bool) -> Executor | None:
        """Where to run a batch of `rows` sequences, the longest of `longest` tokens, `tokens` in all, that
        wants `outputs` (`alone`: no other batch is running): the CUDA graphs' own thread when it will run
        there (`run` there runs without a hop to that thread and back), else None (any thread)."""
        if self.packed_lanes and self.packed_lanes[0].takes(rows, longest, tokens, outputs):
            return self._least_claimed_lane().claim()
        if alone and self.graph_buckets is not None and self.graph_buckets.fits(rows, longest):
            return self.graph_buckets.thread
        return None

    def replay_busy(self, tokens: int, outputs: Iterable[str]) -> bool:
        """Whether work of `tokens` tokens that wants `outputs` would run on a replaying session, but every such
        session has a batch already: it would only wait on a lane's thread, so the batcher keeps it queued,
        where more work joins it, until a lane is free (DynamicBatcher's replay_busy)."""
        lanes = self.packed_lanes
        return (bool(lanes) and (lanes[0].takes_any_size or tokens <= lanes[0].max_tokens)
                and lanes[0].outputs.issuperset(outputs) and all(lane.claims for lane in lanes))

    def replay_next(self, take: Callable[[int, int, frozenset[str]], T | None]) -> T | None:
        """On a replaying session's thread, just after its batch: `take(rows, tokens, outputs)` picks the next
        batch within what replays there, and the session stays claimed for it (so `replay_busy` holds other
        work back meanwhile). The batcher calls this so that a session goes on to the queued work at once,
        not a turn of its event loop later. None (nothing taken) on any other thread."""
        lane = self._lane_here()
        if lane is None:
            return None
        lane.claim()
        taken = None
        try:
            taken = take(lane.max_rows, lane.max_tokens, lane.outputs)
        finally:
            if not taken:
                lane.release()
        return taken or None

    def replay_abandoned(self) -> None:
        """On a lane's thread: the batch claimed for it (replay_thread, replay_next) failed before it reached
        `run`, which ends the claim, so the claim ends here. Elsewhere nothing was claimed."""
        if (lane := self._lane_here()) is not None:
            lane.release()

    def run(self, batch: Batch) -> dict[str, np.ndarray]:
        """A batch that wants only what the host-packed variant answers (no token vectors) runs on it,
        replayed as a CUDA graph, when it fits its buckets. For a model that pools [CLS] that variant computes
        its last layer for the [CLS] rows only (export/last_layer_rows.py) and takes a larger batch too,
        uncaptured: it is then the faster graph at every size (BENCHMARKS.md). A padded graph's CUDA graphs
        take a batch when it is small and the only one on the GPU (a padded replay's synchronous copies would
        wait for a batch running beside it: replaying beside one cost 7-8% at 16-64 texts per request,
        BENCHMARKS.md). On the CPU, a batch that wants only what the artifact's [CLS]-rows graph answers runs
        on that graph, whose last layer is computed at the [CLS] position only. The rest run on the session's
        graph. On a lane's thread, where the batcher claimed the lane for the batch (replay_thread,
        replay_next), the run ends that claim however it ends.
        Raises EngineLost when ONNX Runtime reports a CUDA error that leaves the device unusable, and
        ValueError for a row longer than the model's max_length: its positions past that are untrained, and
        on a GPU the graph would read past its position table without a word (the CPU's refuses them)."""
        claimed = self._lane_here()
        try:
            if batch.input_ids.shape[1] > self.max_length:
                raise ValueError(f"a batch row has {batch.input_ids.shape[1]} tokens, more than the model's "
                                 f"max_length {self.max_length}: texts must be truncated to it before the engine")
            return self._run_batch(batch)
        except Exception as e:  # noqa: BLE001 - ORT raises its own types
            lost = device_lost(e)
            if lost is None:
                raise
            raise lost from e
        finally:
            if claimed is not None:
                claimed.release()

    def _run_batch(self, batch: Batch) -> dict[str, np.ndarray]:
        if self.cls_rows_session is not None and self.cls_rows_outputs.issuperset(batch.outputs):
            return self._run_session(batch, self.cls_rows_session)
        if self.packed_lanes and self.packed_lanes[0].outputs.issuperset(batch.outputs):
            ids, type_ids, lengths = batch.unpadded()
            if self.packed_lanes[0].takes(len(lengths), int(lengths.max()), int(lengths.sum()), batch.outputs):
                return self._packed_lane().run(lengths, ids, type_ids, batch.outputs)
        if self.graph_buckets is None:
            return self._run_session(batch)
        with self._running_lock:
            replay = self._running == 0 and self.graph_buckets.fits(*batch.input_ids.shape)
            self._running += 1
        try:
            if replay:
                return self.graph_buckets.run(batch.input_ids, batch.attention_mask, batch.token_type_ids,
                                              batch.outputs)
            return self._run_session(batch)
        finally:
            with self._running_lock:
                self._running -= 1

    def _packed_lane(self) -> PackedGraphBuckets:
        """The lane whose thread this is (the batcher ran the batch there), else the least claimed one."""
        return self._lane_here() or self._least_claimed_lane()

    def _lane_here(self) -> PackedGraphBuckets | None:
        here = threading.get_ident()
        return next((lane for lane in self.packed_lanes if lane.thread_id == here), None)

    def _least_claimed_lane(self) -> PackedGraphBuckets:
        return min(self.packed_lanes, key=lambda lane: lane.claims)

    def _run_session(self, batch: Batch, session: ort.InferenceSession | None = None) -> dict[str, np.ndarray]:
        """`batch` on `session` (default: the graph's own)."""
        session = session or self.session
        feeds = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
                 "token_type_ids": batch.token_type_ids}
        names = list(batch.outputs)
        if self.device == "cuda":
            binding = session.io_binding()
            for name, value in feeds.items():
                binding.bind_cpu_input(name, value)
            for name in names:
                binding.bind_output(name, "cuda", self.cuda_device_id)
            session.run_with_iobinding(binding)
            values = binding.copy_outputs_to_cpu()
        else:
            values = session.run(names, feeds)
        return {n: np.asarray(v, dtype=np.float32) for n, v in zip(names, values)}

    def health(self, ids: Sequence[int], type_ids: Sequence[int]) -> None:
        """A real forward pass on a padded two-row batch (on the session's graph, and as a CUDA graph when
        batches replay them); raises unless every output is finite."""
        n = len(ids)
        input_ids = np.full((2, n), self.pad_id, dtype=np.int64)
        mask = np.zeros((2, n), dtype=np.int64)
        types = np.zeros((2, n), dtype=np.int64)
        input_ids[0], mask[0], types[0] = ids, 1, type_ids
        input_ids[1, :2], mask[1, :2] = [ids[0], ids[-1]], 1
        probe = Batch(input_ids, mask, types, tuple(sorted(self.outputs)))
        runs = [self._run_session(probe)] + ([self.run(probe)] if self.graph_buckets is not None else [])
        if self.cls_rows_session is not None:
            runs.append(self._run_session(Batch(input_ids, mask, types, tuple(sorted(self.cls_rows_outputs))),
                                          self.cls_rows_session))
        probe_ids, probe_types, lengths = probe.unpadded()
        for lane in self.packed_lanes:  # each session's replay, with the outputs it has
            runs.append(lane.run(lengths, probe_ids, probe_types, tuple(sorted(lane.outputs))))
        for name, value in (item for out in runs for item in out.items()):
            if value.shape[0] != 2 or not np.isfinite(value).all():
                raise EngineError(f"the warm-up forward pass gave a bad {name} (shape {value.shape}, "
                                  f"finite: {bool(np.isfinite(value).all())})")
            if name in (CLS_EMBEDDING, MEAN_EMBEDDING, POOLED_EMBEDDING, TOKEN_EMBEDDINGS) \
                    and value.shape[-1] != self.hidden_size:
                raise EngineError(f"{name} has width {value.shape[-1]}, the manifest says {self.hidden_size}")
