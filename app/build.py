"""Settings -> tokenizer, ONNX Runtime engine and batcher, with the defaults that depend on the device;
`start_in_process`: the one-process deployment's Backend."""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from app.backend import Backend, EngineInfo, InlineTokenizing
from app.batcher import DynamicBatcher, Sequences, collate
from app.cuda_graphs import default_replay_tokens
from app.engine import EngineError, OrtEngine, resolve_device_precision
from app.metrics import Metrics
from app.settings import Settings
from app.tokenization import TextTokenizer, TokenizerFileError
from artifact.manifest import CLS_EMBEDDING, TOKENIZER_FILE, Manifest, ManifestError, read_manifest
from artifact.session import CPU, SessionError

log = logging.getLogger("app")

# What loading an artifact raises when it cannot be served as it is: each says why in its message.
UNSERVABLE = (ManifestError, TokenizerFileError, EngineError, SessionError)


def cannot_serve(model_dir: Path, error: Exception) -> str:
    """The one line that says why the server will not start on `model_dir`."""
    return f"cannot serve {model_dir}: {error}"


def check_settings_fit(settings: Settings, manifest: Manifest) -> None:
    """EngineError (one line) for a setting the model cannot serve: found at start-up, not by every request."""
    if settings.openai_pooling == "pooled" and not manifest.has_pooler:
        raise EngineError("openai_pooling 'pooled' names BERT's pooler, but this model has none: set it to "
                          "another pooling (cls, mean, ...) or leave it unset for the model's own")


def batch_token_budget(settings: Settings, device: str) -> int:
    """The configured budget, else the device's default (see Settings.max_batch_tokens)."""
    if settings.max_batch_tokens is not None:
        return settings.max_batch_tokens
    return 16384 if device == "cuda" else 512


def padding_limit(settings: Settings, device: str) -> float:
    """The configured limit, else the device's default (see Settings.max_padding)."""
    if settings.max_padding is not None:
        return settings.max_padding
    return 0.1 if device == "cpu" else 1.0


def inference_threads(settings: Settings, device: str) -> tuple[int, int | None]:
    """(batches at once, ONNX Runtime threads per batch): the configured values, else the device's
    default. On the CPU one single-threaded batch per core beats one batch over every core (no thread
    hand-offs inside small matrix products; bench/cpu_batch_layout.py, BENCHMARKS.md)."""
    if device == "cuda":  # two: one batch's copies and collation overlap the other's kernels
        return settings.inference_workers or 2, settings.intra_op_threads
    cores = usable_cores()
    workers = settings.inference_workers or cores
    return workers, settings.intra_op_threads or max(1, cores // workers)


def usable_cores() -> int:
    """Cores this process may use: its CPU affinity, capped by a cgroup v2 CPU quota (`docker run --cpus`)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, int(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cores


def load_tokenizer(settings: Settings, folder: Path | None = None) -> tuple[Manifest, TextTokenizer]:
    """The manifest and tokenizer of the artifact at `folder` (default settings.model_dir; an engine
    process's copy for its HTTP workers: app.multiprocess.worker_files)."""
    folder = folder or settings.model_dir
    manifest = read_manifest(folder, graphs=folder == settings.model_dir)
    check_settings_fit(settings, manifest)
    tokenizer = TextTokenizer(folder / TOKENIZER_FILE, manifest.max_length, settings.max_input_chars,
                              manifest.special_tokens)
    return manifest, tokenizer


def build_engine(settings: Settings, manifest: Manifest, tokenizer: TextTokenizer, metrics: Metrics,
                 on_engine_lost: Callable[[], None] | None = None) -> tuple[OrtEngine, DynamicBatcher]:
    """The session (after a real forward pass) and its batcher; raises if the model is unusable.
    `on_engine_lost`: called when a batch finds the engine unusable (EngineLost)."""
    import onnxruntime as ort

    device, precision = resolve_device_precision(settings.device, settings.precision, manifest,
                                                 ort.get_available_providers())
    workers, threads = inference_threads(settings, device)
    host_packed = manifest.graph(precision).host_packed
    wanted = settings.cuda_graph_tokens or default_replay_tokens(host_packed.outputs if host_packed else ())
    replayed_tokens = min(wanted, batch_token_budget(settings, device))  # no batch is larger
    try:
        engine = OrtEngine(settings.model_dir, manifest, device, precision, threads, settings.cuda_device_id,
                           settings.custom_kernels, settings.cuda_graphs, settings.cuda_graph_rows,
                           settings.max_batch_size, replayed_tokens, settings.cuda_graph_lanes,
                           settings.replay_short_lengths, settings.cpu_cls_rows)
    except EngineError as e:
        if settings.device != "auto" or device != "cuda":
            raise
        # onnxruntime-gpu lists the CUDA provider even where no GPU or CUDA library is found.
        log.warning("CUDA did not start (%s); serving on the CPU instead", e)
        device, precision = resolve_device_precision("cpu", settings.precision, manifest, [CPU])
        workers, threads = inference_threads(settings, device)
        engine = OrtEngine(settings.model_dir, manifest, device, precision, threads, cls_rows=settings.cpu_cls_rows)
    probe = tokenizer.encode([("warm-up forward pass", "checks every output")], truncate=True)[0]
    engine.health(probe.ids, probe.type_ids)
    batcher = DynamicBatcher(engine.run, pad_id=engine.pad_id, max_batch_tokens=batch_token_budget(settings, device),
                             max_batch_size=settings.max_batch_size, max_wait_ms=settings.max_wait_ms,
                             max_queued=settings.max_queued_sequences, inference_workers=workers,
                             packed=engine.packed, max_padding=padding_limit(settings, device),
                             max_queue_ms=settings.max_queue_ms, overlap_min_tokens=settings.overlap_min_tokens,
                             metrics=metrics, on_engine_lost=on_engine_lost, replay_thread=engine.replay_thread,
                             replay_busy=engine.replay_busy, replay_next=engine.replay_next,
                             replay_abandoned=engine.replay_abandoned,
                             graph_offers=engine.outputs)
    _measure_speed(engine, batcher, probe.ids, manifest.max_length)
    log.info("engine: %s on %s (%s), %d batch(es) at once", engine.graph_file, device, engine.provider, workers)
    return engine, batcher


# Length of the start-up batch's sequences: a typical request's, not the longest the model takes.
_WARM_UP_LENGTH = 128
# Our operator times cuBLASLt's candidates the first time it meets a product of this many rows (tokens) or
# more in each power of two of rows (kTuneMinRows, custom_kernels/src/matmul_epilogues.cc): 50-100 ms that,
# met under load, held up every request in flight (a one-text p99 of 71 ms against 28-38 ms on an H100,
# BENCHMARKS.md). Start-up pays it instead, with a batch in each such power of two the batcher can form.
_TUNED_FROM_TOKENS = 4096


def _measure_speed(engine: OrtEngine, batcher: DynamicBatcher, ids: np.ndarray, max_length: int) -> None:
    """Run one full batch of the kind the batcher forms before serving and time it: the speed the queue's
    admission by time (max_queue_ms) goes by until the first real batch finishes. Without it the admission
    knew no speed at start and refused a burst that came at once (41-101 requests answered 429 in
    bench/replicas.py's first runs on H100s). On a GPU untimed runs go first: one of every power of two of
    tokens from _TUNED_FROM_TOKENS up, and the full batch, so the kernels are set up and tuned for them (our
    operator's choices are the process's, made once for every session: ChosenAlgos in
    custom_kernels/src/matmul_epilogues.cc), and on every session that runs such batches
    (OrtEngine.warm_up_outputs) so that its own memory arena has grown for them. Costs a batch's time at
    start (0.17 s for all-MiniLM-L6-v2 int8 on 2 CPU cores), on a GPU those runs too (two a session with the
    default budget)."""
    length = min(_WARM_UP_LENGTH, max_length)
    row = np.resize(ids, length)  # the probe's tokens repeated: what they are does not change the time

    def batch_of(rows: int, outputs: frozenset[str] = frozenset({CLS_EMBEDDING})):
        return collate(Sequences(np.tile(row, rows), np.zeros(rows * length, dtype=np.int64),
                                 np.full(rows, length, dtype=np.int64)), engine.pad_id, outputs)

    rows = max(1, min(batcher.max_batch_size, batcher.max_batch_tokens // length))
    batch = batch_of(rows)
    if engine.device == "cuda":
        sizes, tokens = [], _TUNED_FROM_TOKENS
        while tokens < rows * length:
            sizes.append(tokens // length)
            tokens *= 2
        for size in sizes + [rows]:
            for outputs in engine.warm_up_outputs:  # each session that runs large batches grows its arena
                engine.run(batch_of(size, outputs))
    started = time.perf_counter()
    engine.run(batch)
    batcher.speed.assume(rows * length, time.perf_counter() - started)


# One text below this many characters is tokenised on the event loop: a thread hop costs more. Several
# texts go to a thread, where the tokenizers library runs without the GIL (plain ASCII without offsets is
# tokenised word by word in Python and holds it, a few µs a text, while the loop still gets its turns).
IN_PROCESS_INLINE_TOKENIZING = InlineTokenizing(max_texts=1, max_chars=4096)


async def start_in_process(settings: Settings, manifest: Manifest, tokenizer: TextTokenizer, metrics: Metrics,
                           on_lost=None) -> Backend:
    """The one-process deployment: this process's engine and batcher. The engine is lost when its device
    is (EngineLost): `on_lost` then, and the app answers 503."""
    engine, batcher = build_engine(settings, manifest, tokenizer, metrics, on_lost)
    batcher.start()
    return Backend(batcher, EngineInfo.of(engine, batcher), IN_PROCESS_INLINE_TOKENIZING)
