"""The ONNX Runtime backend: one session over the artifact's graph; `health()` and `run(batch)` only.

CPU runs the fp32 (or int8) graph with numpy in / out; CUDA runs the fp16 graph with IO binding and
copies back only the outputs the batch needs. Pooling, normalisation and softmax are not done here.
"""
from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from app.cuda_graphs import MAX_ROWS, CudaGraphBuckets
from app.errors import EngineLost
from artifact.manifest import CLS_EMBEDDING, INPUT_NAMES, POOLED_EMBEDDING, TOKEN_EMBEDDINGS, GraphInfo, Manifest
from artifact.session import CUDA, SessionError, kernels_library, open_graph

log = logging.getLogger("app.engine")


class EngineError(RuntimeError):
    """The engine cannot start as configured; the message says what to change."""


@dataclass(frozen=True, slots=True)
class Batch:
    input_ids: np.ndarray  # [B, S] int64, padded with [PAD] to the longest in the batch
    attention_mask: np.ndarray  # [B, S] int64, 1 on real tokens
    token_type_ids: np.ndarray  # [B, S] int64
    outputs: tuple[str, ...]  # graph outputs wanted by at least one entry


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
    if precision == "fp16" and device != "cuda":
        raise EngineError("the fp16 graph runs on CUDA only; use precision fp32 or int8 on the CPU")
    if precision == "int8" and device != "cpu":
        raise EngineError("the int8 graph runs on the CPU only")
    manifest.graph(precision)  # raises ManifestError naming the graphs the artifact has
    return device, precision


class OrtEngine:
    def __init__(self, folder: Path, manifest: Manifest, device: str, precision: str,
                 intra_op_threads: int | None = None, cuda_device_id: int = 0, kernels: str = "auto",
                 cuda_graphs: str = "auto", cuda_graph_rows: int = MAX_ROWS):
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
        self.packed = graph.packed  # padded tokens cost nothing: the batcher packs by tokens, not rows
        self.pad_id = manifest.special_tokens.get("[PAD]", 0)
        self.graph_buckets = self._open_graph_buckets(folder, graph, library if self.custom_kernels else None,
                                                      cuda_graphs, manifest.max_length, cuda_graph_rows)
        self._running = 0  # batches on the GPU now, from any inference thread
        self._running_lock = threading.Lock()

    @property
    def cuda_graphs(self) -> bool:
        return self.graph_buckets is not None

    def _open_graph_buckets(self, folder: Path, graph: GraphInfo, library: Path | None, choice: str,
                            max_length: int, max_rows: int) -> CudaGraphBuckets | None:
        """Small batches on the padded twin as CUDA graphs (app/cuda_graphs.py), captured now. choice
        "auto": when on CUDA and the artifact has the twin; "on": both required; "off": never. With the
        custom kernels running (`library`), the twin's kernels variant."""
        if choice not in ("auto", "on", "off"):
            raise EngineError(f"cuda_graphs must be auto, on or off, not {choice!r}")
        if choice == "off" or (choice == "auto" and (self.device != "cuda" or graph.padded is None)):
            return None
        if self.device != "cuda" or graph.padded is None:
            raise EngineError("cuda_graphs on needs CUDA and an artifact with a padded twin of its fp16 graph "
                              "(python -m export --device cuda writes one unless --no-cuda-graphs)")
        try:
            path, session = open_graph(folder, graph.padded, self.device, library=library,
                                       kernels_required=library is not None, device_id=self.cuda_device_id,
                                       cuda_graph=True, intra_op_threads=self.intra_op_threads)
            buckets = CudaGraphBuckets(session, self.device, self.cuda_device_id, max_length, self.pad_id,
                                       max_rows=max_rows)
            buckets.capture()
        except Exception as e:  # noqa: BLE001 - ORT raises its own types
            if choice == "on":
                raise EngineError(f"CUDA graphs of the padded twin failed: {e}") from e
            log.warning("CUDA graphs of the padded twin failed (%s); small batches run on %s", e, self.graph_file)
            return None
        log.info("small batches (up to %d x %d tokens) replay CUDA graphs of %s", buckets.rows[-1],
                 buckets.lengths[-1], path.name)
        return buckets

    def replay_thread(self, rows: int, length: int) -> Executor | None:
        """Where to run a batch of `rows` sequences of up to `length` tokens that finds the GPU idle: the CUDA
        graphs' own thread when it will replay one (`run` there replays without a hop to that thread and
        back), else None (any thread)."""
        if self.graph_buckets is None or not self.graph_buckets.fits(rows, length):
            return None
        return self.graph_buckets.thread

    def run(self, batch: Batch) -> dict[str, np.ndarray]:
        """A small batch replays a CUDA graph when it is the only batch on the GPU; the rest run on the
        session's graph. Only alone: a replay's input and output copies are synchronous and wait for a
        batch running beside it (replaying beside one cost 7-8% at 16-64 texts per request, BENCHMARKS.md).
        Raises EngineLost when ONNX Runtime reports a CUDA error that leaves the device unusable."""
        try:
            return self._run_batch(batch)
        except Exception as e:  # noqa: BLE001 - ORT raises its own types
            lost = device_lost(e)
            if lost is None:
                raise
            raise lost from e

    def _run_batch(self, batch: Batch) -> dict[str, np.ndarray]:
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

    def _run_session(self, batch: Batch) -> dict[str, np.ndarray]:
        feeds = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
                 "token_type_ids": batch.token_type_ids}
        names = list(batch.outputs)
        if self.device == "cuda":
            binding = self.session.io_binding()
            for name, value in feeds.items():
                binding.bind_cpu_input(name, value)
            for name in names:
                binding.bind_output(name, "cuda", self.cuda_device_id)
            self.session.run_with_iobinding(binding)
            values = binding.copy_outputs_to_cpu()
        else:
            values = self.session.run(names, feeds)
        return {n: np.asarray(v, dtype=np.float32) for n, v in zip(names, values)}

    def health(self, ids: Sequence[int], type_ids: Sequence[int]) -> None:
        """A real forward pass on a padded two-row batch (on the session's graph, and as a CUDA graph when
        small batches replay them); raises unless every output is finite."""
        n = len(ids)
        input_ids = np.full((2, n), self.pad_id, dtype=np.int64)
        mask = np.zeros((2, n), dtype=np.int64)
        types = np.zeros((2, n), dtype=np.int64)
        input_ids[0], mask[0], types[0] = ids, 1, type_ids
        input_ids[1, :2], mask[1, :2] = [ids[0], ids[-1]], 1
        probe = Batch(input_ids, mask, types, tuple(sorted(self.outputs)))
        runs = [self._run_session(probe)] + ([self.run(probe)] if self.graph_buckets is not None else [])
        for name, value in (item for out in runs for item in out.items()):
            if value.shape[0] != 2 or not np.isfinite(value).all():
                raise EngineError(f"the warm-up forward pass gave a bad {name} (shape {value.shape}, "
                                  f"finite: {bool(np.isfinite(value).all())})")
            if name in (CLS_EMBEDDING, POOLED_EMBEDDING, TOKEN_EMBEDDINGS) and value.shape[-1] != self.hidden_size:
                raise EngineError(f"{name} has width {value.shape[-1]}, the manifest says {self.hidden_size}")
