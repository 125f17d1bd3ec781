"""Small batches replayed as CUDA graphs (`python -m export --device cuda` writes the graph they need).

A batch of a few short texts costs ONNX Runtime about as much CPU time as a large one: it launches
every kernel of the graph one by one, from a thread that has often just woken up. A replayed CUDA graph
launches them all at once (what that saves: bench/engine_idle_gaps.py, BENCHMARKS.md). A CUDA graph needs fixed shapes
and fixed addresses, which the packed graph (its shapes follow the data) cannot give, so small batches
run on the artifact's padded twin of it: one captured graph per (rows, length) bucket, each with its own
input and output buffers on the device, the batch padded up to the smallest bucket that holds it.

ONNX Runtime keeps captured graphs per calling thread (the CUDA provider's per-thread context): a graph
captured in one thread is captured again in the next, and a capture beside a running batch fails both.
So one thread of our own captures every bucket at start-up and runs every replay.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from artifact.manifest import INPUT_NAMES

MAX_ROWS = 16  # the largest batch captured by default; a larger batch runs on the packed graph
LENGTHS = (16, 32, 64, 128)  # sequence lengths captured (up to the model's maximum)
_RUNS_TO_CAPTURE = 3  # ORT runs a graph normally before it captures it


def rows_up_to(max_rows: int) -> tuple[int, ...]:
    """Batch sizes captured: the powers of two below `max_rows`, then `max_rows`."""
    if max_rows < 1:
        raise ValueError(f"CUDA graphs need at least 1 row, not {max_rows}")
    return tuple(1 << i for i in range(max_rows.bit_length()) if 1 << i < max_rows) + (max_rows,)


@dataclass
class _Bucket:
    rows: int
    length: int
    binding: ort.IOBinding
    inputs: dict[str, ort.OrtValue]
    outputs: dict[str, ort.OrtValue]
    run_options: ort.RunOptions


class CudaGraphBuckets:
    """`session` (created with the CUDA provider's enable_cuda_graph) over fixed-shape buckets. `run`
    takes the same padded int64 arrays as the packed graph and answers float32 outputs cut back to the
    batch's own rows and length. One batch at a time, on the buckets' own thread."""

    def __init__(self, session: ort.InferenceSession, device: str, device_id: int, max_length: int, pad_id: int,
                 max_rows: int = MAX_ROWS, lengths: tuple[int, ...] | None = None):
        self.session, self.device, self.device_id, self.pad_id = session, device, device_id, pad_id
        self.rows = rows_up_to(max_rows)
        self.lengths = tuple(sorted({min(n, max_length) for n in lengths or LENGTHS}))
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="cuda-graphs")  # the only caller of the session
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
                self._thread.submit(self._run, bucket, ids, np.ones_like(ids), np.zeros_like(ids), ()).result()

    def fits(self, rows: int, length: int) -> bool:
        return rows <= self.rows[-1] and length <= self.lengths[-1]

    def run(self, input_ids: np.ndarray, attention_mask: np.ndarray, token_type_ids: np.ndarray,
            outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        rows, length = input_ids.shape
        bucket = self._buckets[next(r for r in self.rows if r >= rows), next(n for n in self.lengths if n >= length)]
        ids = np.full((bucket.rows, bucket.length), self.pad_id, np.int64)
        mask = np.zeros_like(ids)
        types = np.zeros_like(ids)
        ids[:rows, :length], mask[:rows, :length], types[:rows, :length] = input_ids, attention_mask, token_type_ids
        mask[rows:, 0] = 1  # rows that only fill the bucket attend to one token: no empty softmax
        values = self._thread.submit(self._run, bucket, ids, mask, types, outputs).result()
        return {name: v[:rows, :length] if v.ndim == 3 else v[:rows] for name, v in values.items()}

    def _run(self, bucket: _Bucket, ids: np.ndarray, mask: np.ndarray, types: np.ndarray,
             outputs: tuple[str, ...]) -> dict[str, np.ndarray]:
        for name, value in zip(INPUT_NAMES, (ids, mask, types)):
            bucket.inputs[name].update_inplace(value)
        self.session.run_with_iobinding(bucket.binding, bucket.run_options)
        return {name: bucket.outputs[name].numpy() for name in outputs}  # copies to the host

