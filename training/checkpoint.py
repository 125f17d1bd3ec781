"""Training checkpoints: the complete state of a run in one file per step (`ckpt-00001000.pt` in the
run folder), written atomically, the last K kept, checked against the configuration that resumes it."""
from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from training.writes import process_alive, write_failed

FORMAT_VERSION = 1
_NAME = re.compile(r"^ckpt-(\d{8,})\.pt$")
_TEMPORARY = re.compile(r"^\.ckpt-\d{8,}\.pt\.tmp-(\d+)$")  # a write in progress, by that process


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: corrupt, or from another configuration; the message says what to do."""


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"ckpt-{step:08d}.pt"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Finished checkpoints in `run_dir`, oldest first (temporary files of an interrupted write are skipped)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep: int) -> Path:
    """Write `state` as the checkpoint of `step`, then delete all but the newest `keep` checkpoints.

    The bytes go to a temporary name first and are renamed into place after an fsync, so a crash
    mid-write leaves the previous checkpoint as the newest complete one."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = checkpoint_path(run_dir, step)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e.__context__, KeyboardInterrupt):  # Ctrl-C within torch.save, whose writer then fails
            raise KeyboardInterrupt from None  # an interrupted run, not a write that failed
        if isinstance(e, (OSError, RuntimeError)):
            raise write_failed(path, e) from e
        raise
    _fsync_dir(run_dir)
    for old in list_checkpoints(run_dir)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return path


def remove_stale_temporaries(run_dir: Path) -> list[Path]:
    """Delete what interrupted checkpoint writes left (`.ckpt-*.pt.tmp-PID`), except a live process's:
    another run may be writing into the same folder."""
    run_dir = Path(run_dir)
    stale = [p for p in (run_dir.iterdir() if run_dir.is_dir() else [])
             if (m := _TEMPORARY.match(p.name)) and not process_alive(int(m.group(1)))]
    for path in stale:
        path.unlink(missing_ok=True)
    return stale


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # not supported on every platform / filesystem
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Read one checkpoint onto the CPU. A corrupt or truncated file is an error naming it (we do not
    fall back to an older one silently: losing steps should be the user's decision)."""
    path = Path(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated zip, bad pickle, I/O error: all mean the same to the user
        older = [p.name for p in list_checkpoints(path.parent) if p != path]
        hint = (f"delete it to resume from {older[-1]}" if older
                else "delete it (and pass no --resume) to start over")
        raise CheckpointError(f"checkpoint {path} is corrupt or truncated ({type(e).__name__}); {hint}") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path} is not a checkpoint of this trainer (format "
                              f"{state.get('format') if isinstance(state, dict) else '?'}, expected {FORMAT_VERSION})")
    return state


def check_compatible(path: Path, state: dict[str, Any], expected: dict[str, dict]) -> None:
    """Refuse a checkpoint whose recorded settings differ from `expected` in any listed section
    (e.g. {"model_config": ..., "data_config": ...}): its weights or data position would be meaningless.
    A setting (or section) that an older checkpoint lacks counts as None, the default of those added since."""
    for section, want in expected.items():
        have = state.get(section, {})
        diffs = [f"{k} {have.get(k)!r} (now {want.get(k)!r})" for k in sorted(set(have) | set(want))
                 if have.get(k) != want.get(k)] if isinstance(have, dict) else [repr(have)]
        if diffs:
            raise CheckpointError(
                f"checkpoint {path} was made with another configuration: {', '.join(diffs[:4])}; "
                f"pass the settings it was made with, or choose a new --run-dir to start a fresh run"
            )


def check_world_size(path: Path, state: dict[str, Any], world_size: int) -> None:
    """Refuse a checkpoint written by another number of processes: it holds each one's random state."""
    if len(state["rng"]) != world_size:
        raise CheckpointError(f"checkpoint {path} was written with world size {len(state['rng'])}; resume with "
                              f"the same number of processes (now {world_size}): it holds each one's random state")


def rng_state(device: torch.device) -> dict[str, Any]:
    """Every random generator training draws from (dropout; anything seeded by python or numpy)."""
    np_state = np.random.get_state()
    state = {
        "python": random.getstate(),
        # numpy's state holds an ndarray, which weights_only loading refuses: store it as a tensor.
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "torch": torch.get_rng_state(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)
