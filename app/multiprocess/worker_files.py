"""The artifact files an HTTP worker reads (manifest, tokenizer, Dense layers), as its engine process
serves them.

A worker reads them when it starts, and a worker that dies is started again while the server runs. Had
it read the artifact's folder, a model exported into that folder meanwhile would give it the new
tokenizer against the engine's old graph: wrong vectors, and no error. So each engine process copies
them into the server's private run folder, checked against the manifest it serves, and its workers read
that copy: the server serves the model it started with until it is restarted, as one process does."""
from __future__ import annotations

import shutil
from pathlib import Path

from artifact.manifest import DENSE_FILE, MANIFEST_FILE, TOKENIZER_FILE, Manifest, ManifestError, read_manifest

_WORKER_FILES = (MANIFEST_FILE, TOKENIZER_FILE, DENSE_FILE)  # the last only where the model has Dense layers


def worker_files_dir(engine_socket: str) -> Path:
    """Where the engine listening on `engine_socket` keeps the copy its workers read."""
    socket = Path(engine_socket)
    return socket.with_name(socket.stem + "-artifact")


def copy_worker_files(model_dir: Path, to: Path) -> Manifest:
    """Copies the worker files of the artifact at `model_dir` to the new folder `to`; their manifest, once
    each copy is the file it names (else ManifestError: the artifact was being exported into)."""
    to.mkdir()
    for name in _WORKER_FILES:
        try:
            shutil.copyfile(model_dir / name, to / name)
        except FileNotFoundError:
            if name != DENSE_FILE:
                raise ManifestError(f"{model_dir} lacks {name}; re-export it") from None
        except OSError as e:
            raise ManifestError(f"{model_dir / name} cannot be read ({e.strerror})") from e
    manifest = read_manifest(to, graphs=False)
    try:
        manifest.verify(to, [TOKENIZER_FILE] + ([DENSE_FILE] if manifest.sentence_dense else []))
    except ManifestError as e:
        raise ManifestError(f"the artifact's files changed while the server read them (was it being exported "
                            f"into?): {e}") from e
    return manifest
