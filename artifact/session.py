"""ONNX Runtime sessions over an artifact's graphs, one way for export, the server and the benchmarks: the
CUDA libraries preloaded, our operator library registered, the provider checked (never a silent fallback
from CUDA to the CPU), and the custom-kernels choice (auto / on / off) read in one place. No torch here.
"""
from __future__ import annotations

import functools
import logging
from pathlib import Path

import onnxruntime as ort

import custom_kernels
from artifact.manifest import GraphInfo, HostPackedGraph, PaddedGraph

log = logging.getLogger("artifact.session")
CUDA, CPU = "CUDAExecutionProvider", "CPUExecutionProvider"
DEVICES = ("cpu", "cuda")


class SessionError(RuntimeError):
    """ONNX Runtime cannot run a graph as asked; the message says what to change."""


def require_cuda() -> None:
    """Raise SessionError unless this onnxruntime offers the CUDA provider (after preloading the CUDA and
    cuDNN libraries that pip packages ship)."""
    _set_up_cuda()
    if CUDA not in ort.get_available_providers():
        raise SessionError(f"device cuda needs onnxruntime-gpu with a CUDA device; this onnxruntime "
                           f"{ort.__version__} offers {', '.join(ort.get_available_providers())}")


@functools.cache
def _set_up_cuda() -> None:
    """Once a process: the CUDA libraries preloaded, and ONNX Runtime's default logger at errors only, as
    the sessions are. onnxruntime >= 1.30 warns there "No registered plugin EP device found for
    'CUDAExecutionProvider'" at every CUDA session (its lookup of plugin providers; the built-in one still
    runs, which open_session checks), a line in its own format in the server's log."""
    ort.set_default_logger_severity(3)
    if hasattr(ort, "preload_dlls"):  # onnxruntime >= 1.21
        try:
            ort.preload_dlls()
        except Exception as e:  # noqa: BLE001 - best effort; the provider check says what is missing
            log.warning("onnxruntime.preload_dlls() failed: %s", e)


def kernels_library(choice: str, device: str) -> Path | None:
    """The custom_kernels library to register under `choice`: "off" none; "auto" the one found, if any;
    "on" the one found, else SessionError. Our operators run on CUDA only: on the CPU none ("on": an error)."""
    if choice not in custom_kernels.CHOICES:
        raise SessionError(f"custom kernels must be one of {', '.join(custom_kernels.CHOICES)}, not {choice!r}")
    if device != "cuda":
        if choice == "on":
            raise SessionError("custom kernels on: our operators run on CUDA only")
        return None
    try:
        return custom_kernels.library_for(choice)
    except custom_kernels.KernelsUnavailable as e:
        raise SessionError(str(e)) from e


def open_session(path: Path, device: str, *, library: Path | None = None, device_id: int = 0,
                 cuda_graph: bool = False, intra_op_threads: int | None = None) -> ort.InferenceSession:
    """A session over the graph file `path` on `device` ("cpu" | "cuda"), with our operator `library`
    registered when given. `cuda_graph`: ORT captures the graph on its first runs and replays it after
    (fixed shapes and addresses: IO binding). `intra_op_threads` None: ONNX Runtime's choice."""
    if device not in DEVICES:
        raise SessionError(f"device must be one of {', '.join(DEVICES)}, not {device!r}")
    options = _options(intra_op_threads)
    if device == "cuda":
        require_cuda()
        providers: list = [(CUDA, {"device_id": str(device_id), "enable_cuda_graph": "1" if cuda_graph else "0"})]
    else:
        providers = [CPU]
    try:
        if library is not None:
            options.register_custom_ops_library(str(library))
        session = ort.InferenceSession(str(path), options, providers=providers)
    except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
        with_library = f" with {library}" if library is not None else ""
        raise SessionError(f"onnxruntime could not load {path.name} on {device}{with_library}: {e}") from e
    if device == "cuda" and session.get_providers()[0] != CUDA:
        raise SessionError(f"onnxruntime would run {path.name} on {session.get_providers()[0]}, not CUDA: the CUDA "
                           f"provider did not start (CUDA / cuDNN libraries missing?)")
    return session


def open_graph(folder: Path, graph: GraphInfo | PaddedGraph | HostPackedGraph, device: str, *, library: Path | None,
               kernels_required: bool, **options) -> tuple[Path, ort.InferenceSession]:
    """(path, session) over `graph`'s custom-kernels variant when it has one and `library` is given (see
    kernels_library), else over its plain file. A variant that does not load falls back to the plain file
    with a warning, unless `kernels_required`; then, as for a missing variant, SessionError. `options`
    are open_session's."""
    if kernels_required and graph.custom_kernels is None:
        raise SessionError(f"custom kernels on, but this artifact has no custom-kernels graph beside {graph.file}: "
                           f"export it on the GPU with the library built (bash custom_kernels/build.sh)")
    if library is not None and graph.custom_kernels is not None:
        path = folder / graph.custom_kernels.file
        try:
            return path, open_session(path, device, library=library, **options)
        except SessionError as e:
            if kernels_required:
                raise
            log.warning("custom kernels did not load (%s); running the plain %s graph", e, graph.file)
    path = folder / graph.file
    return path, open_session(path, device, **options)


def _options(intra_op_threads: int | None) -> ort.SessionOptions:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    if intra_op_threads:
        options.intra_op_num_threads = intra_op_threads
    # Idle intra-op threads otherwise spin, taking CPU from the server's event loop and tokenizer.
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3  # errors only: the checks here say what went wrong
    return options
