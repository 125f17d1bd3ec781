"""`python -m app --model-dir DIR [--host H] [--port P] [--workers N] [...]`: serve an artifact folder.

One process (`--workers 1`, the default) has one ONNX Runtime session and one batcher; with more, see
app/multiprocess/. Every public Settings field is a flag here and a BERTSERVE_* environment variable; flags win."""
from __future__ import annotations

import os
import signal

# ONNX Runtime (1.29 and later) sends usage events to Microsoft from Linux too unless this is set; the
# images set it, and so does the server wherever it runs (ORT_DISABLE_TELEMETRY=0 to allow them).
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")

if __name__ == "__main__":
    # Ctrl-C while the modules import would end in a traceback from deep inside one of them (or an error
    # that hides it); a SIGTERM then would be lost where this is PID 1 (a container's: the kernel drops a
    # signal PID 1 has no handler for), and the server would start and serve until SIGKILL. Both stay
    # pending until the modules have imported, and then get one quiet exit.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})

import argparse
import logging
import sys
import types
import typing
from pathlib import Path

from pydantic import ValidationError
from pydantic_core import PydanticUndefined

from app.heap import keep_freed_memory
from app.settings import ENV_PREFIX, Settings, configure_logging, shown_default, unknown_variables


def parse_args(argv: list[str] | None = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(prog="python -m app", description=__doc__.split("\n\n")[0],
                                     epilog=f"Each flag can also be given as an environment variable, e.g. "
                                            f"{ENV_PREFIX}MODEL_DIR, {ENV_PREFIX}MAX_BATCH_TOKENS.")
    for name, field in Settings.model_fields.items():
        text = field.description or ""
        if field.default not in (None, PydanticUndefined):
            text += f" (default: {shown_default(field.default)})"
        parser.add_argument("--" + name.replace("_", "-"), dest=name, metavar=_metavar(name, field.annotation),
                            help=text.replace("%", "%%"))  # argparse %-formats help strings
    return {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}


def _metavar(name: str, annotation) -> str:
    """What the flag takes: its choices, N for a count, else the setting's last word (DIR, MS, KEY)."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    kinds = [a for a in (typing.get_args(annotation) if union else (annotation,)) if a is not type(None)]
    if len(kinds) == 1 and typing.get_origin(kinds[0]) is typing.Literal:
        return "{" + ",".join(map(str, typing.get_args(kinds[0]))) + "}"
    if kinds == [bool]:
        return "{true,false}"
    if kinds == [int] and not name.endswith(("_port", "_id", "_ms", "_s")) and name != "port":
        return "N"
    return name.split("_")[-1].upper()


def _stop_before_serving(*_) -> None:
    """SIGTERM before the server serves: nothing to drain, an orderly stop (exit 0, as the launcher's while
    engines load)."""
    raise SystemExit(0)


def _bad_setting(error: dict) -> str:
    """One of pydantic's errors in words naming the setting as it may be given: its flag and its variable."""
    name = ".".join(map(str, error["loc"]))
    if not name:  # a check of several settings together: its message names them
        return error["msg"]
    return f"{name} (--{name.replace('_', '-')}, {ENV_PREFIX}{name.upper()}): {error['msg']}"


def main(argv: list[str] | None = None) -> int:
    flags = parse_args(argv)
    try:
        settings = Settings(**flags)
    except ValidationError as e:
        print("bad settings: " + "; ".join(_bad_setting(err) for err in e.errors()), file=sys.stderr)
        return 2
    configure_logging(settings)
    for name, closest in unknown_variables(dict(os.environ)):
        logging.getLogger("app").warning("%s is not a setting: ignored%s", name,
                                         f" (did you mean {closest}?)" if closest else "")
    keep_freed_memory()  # before the model's arrays: the launcher, or the whole server in one process

    import uvicorn

    import onnxruntime as ort

    from app.build import cannot_serve, check_settings_fit
    from app.engine import EngineError, resolve_device_precision
    from app.main import create_app
    from app.metrics import MULTIPROC_DIR_VAR, use_metrics_folder
    from app.uvicorn_server import ServingServer, listening_socket, uvicorn_options
    from artifact.manifest import ManifestError, read_manifest
    from artifact.session import SessionError, kernels_library

    signal.signal(signal.SIGTERM, _stop_before_serving)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # held since the top of this file

    try:  # a port already taken is said now, not after the model has loaded
        listening_socket(settings.host, settings.port).close()
    except OSError as e:
        print(f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    try:  # fail fast with one line, before uvicorn starts, when the folder is not an artifact or a file
        # differs from what export wrote (hashed once here, for every process the server starts)
        manifest = read_manifest(settings.model_dir)
        manifest.verify(settings.model_dir, manifest.files_sha256)
        check_settings_fit(settings, manifest)
        # a device this onnxruntime cannot run, a precision it or the artifact lacks, or operators asked for
        # but not found: said now, not in a traceback later
        device, _ = resolve_device_precision(settings.device, settings.precision, manifest,
                                             ort.get_available_providers())
        kernels_library(settings.custom_kernels, device)
    except (ManifestError, EngineError, SessionError) as e:
        print(cannot_serve(settings.model_dir, e), file=sys.stderr)
        return 2
    # uvicorn raises a stop signal again after its shutdown, for the signal's default action (SIGTERM: exit
    # 143). A drained stop is an orderly end: exit 0, as a supervisor expects of a clean stop.
    signal.signal(signal.SIGTERM, lambda *_: None)
    if settings.workers > 1:
        from app.multiprocess.launcher import serve_with_workers

        return serve_with_workers(settings, flags, device)
    if os.environ.get(MULTIPROC_DIR_VAR):  # a metrics folder named for the server: this run's values alone
        use_metrics_folder(Path(os.environ[MULTIPROC_DIR_VAR]))
    front = create_app(settings)
    config = uvicorn.Config(front, host=settings.host, port=settings.port, **uvicorn_options(settings, front.metrics))
    try:
        ServingServer(config, on_stop=front.drain, busy=front.busy).run()
    except KeyboardInterrupt:  # Ctrl-C raised again after the shutdown
        pass
    except SystemExit:  # uvicorn's 3 for a failed start-up: 2 where the model cannot be served, as above
        if getattr(front.state, "startup_error", None):
            return 2
        raise
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C while the server was starting: nothing was serving yet
        # A string exec clears CPython's mark of an interrupt that ended one (see
        # training.stop_signals.forget_caught_interrupt), else `python -m app` dies of SIGINT, not 130.
        exec("pass", {})
        sys.exit(130)
