"""The run's output folders checked before training starts, and a failed write told in one line that
names the file (a full disk as such) instead of torch's `[enforce fail at inline_container.cc]`."""
from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path

from artifact.source_folder import CONFIG_FILE


class WriteError(Exception):
    """A file of the run could not be written; the message names it and says why."""


def settled_path(path: str | Path) -> str:
    """`path` as given, or with its parent resolved where it goes through "..": a folder that is replaced
    whole by renames in its parent must be named through a parent that stays put, and `a/m/../m` names
    `m` through `m` itself, which the first rename (m -> .m.old) takes away. The last component is kept
    (a link stays a link)."""
    p = Path(path).expanduser()
    if ".." not in p.parts:
        return str(path)
    return str(p.resolve() if p.name in ("", ".", "..") else p.parent.resolve() / p.name)


def check_writable(folder: Path, flag: str, *, replaced_whole: bool = False) -> None:
    """Fail now, not after hours of training, when `folder` (the value of `flag`) cannot be written: its
    parent when it is `replaced_whole` (a model folder is written next to it, then renamed). Probes the
    nearest folder that exists, with a temporary file, so that a run refused later leaves nothing behind."""
    existing = Path(folder).absolute().parent if replaced_whole else Path(folder).absolute()
    while not existing.exists():
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(existing))
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise WriteError(f"{flag} {folder}: cannot write in {existing} ({e.strerror or e}); "
                         f"choose a writable folder") from e


RUN_LOCK_FILE = ".lock"  # in --run-dir while a training writes into it


def out_lock_file(out: Path) -> Path:
    """Beside --out while a training will write it there: the model folder is replaced whole at the end,
    so the lock cannot be inside it."""
    out = Path(out)
    return out.parent / f".{out.name}.lock"


def check_run_dir_free(run_dir: Path) -> None:
    """Fail now, in one line that names it, when another training holds --run-dir (run_dir_held), before
    any other check of the folder speaks of its files. Reads only: a refused run writes nothing."""
    _check_free(Path(run_dir) / RUN_LOCK_FILE, functools.partial(_run_dir_in_use, run_dir))


def check_out_free(out: Path) -> None:
    """Fail now when another training will write the same --out (out_held), even from another --run-dir:
    the last to end would replace the other's model. Reads only."""
    _check_free(out_lock_file(out), functools.partial(_out_in_use, out))


def _run_dir_in_use(run_dir: Path, owner: str) -> str:
    return (f"--run-dir {run_dir} is in use by another training ({owner}); wait for it to end, or pass another "
            f"--run-dir (or --out)")


def _out_in_use(out: Path, owner: str) -> str:
    return (f"--out {out} is where another training ({owner}) will write its model; wait for it to end, or "
            f"pass another --out")


def _check_free(lock: Path, in_use: Callable[[str], str]) -> None:
    try:
        held = open(lock, "r+")
    except OSError:  # none (no training holds it), or unreadable: _held says so
        return
    with held:
        if not _try_lock(held):
            raise _refusal(held, in_use)
        # closing lets go of the lock just taken (a POSIX lock ends with any of its process's descriptors)


def _try_lock(held) -> bool:
    """Takes the lock on `held`'s file; False when another process holds it. A filesystem without locks
    (some NFS mounts) counts as taken: the run goes on unguarded."""
    try:
        fcntl.lockf(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):
            return False
    return True


def _refusal(held, in_use: Callable[[str], str]) -> WriteError:
    """in_use(the holder, as its lock file names it) as the error."""
    held.seek(0)
    return WriteError(in_use(held.read().strip() or "another process"))


def run_dir_held(run_dir: Path) -> contextlib.AbstractContextManager[None]:
    """Holds --run-dir for this training: a second training into it (its checkpoints and metrics would
    interleave with this one's, and one would delete the other's with --fresh) is refused in one line."""
    run_dir = Path(run_dir)
    return _held(run_dir / RUN_LOCK_FILE, functools.partial(_run_dir_in_use, run_dir),
                 f"--run-dir {run_dir}: cannot write in it")


def out_held(out: Path) -> contextlib.AbstractContextManager[None]:
    """Holds --out for this training, from its checks to its model written: a second training to the same
    --out, from another --run-dir, is refused in one line instead of one model silently replacing the other."""
    lock = out_lock_file(out)
    return _held(lock, functools.partial(_out_in_use, out), f"--out {out}: cannot write in {lock.parent}")


@contextlib.contextmanager
def _held(lock: Path, in_use: Callable[[str], str], cannot_write: str) -> Iterator[None]:
    """Holds the lock file `lock`, made with its folder, and says who holds it in it. A POSIX record lock:
    the kernel lets go of it when this process ends, however it ends, so no stale lock needs clearing, and
    unlike an flock the data loader's forked workers do not hold it on after a kill -9. The file is removed
    when the run ends, and with it the folders made for it that are still empty."""
    folder = lock.parent
    made = [f for f in [folder, *folder.parents] if not f.exists()]  # innermost first
    while True:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            held = open(lock, "a+")
        except OSError as e:
            raise WriteError(f"{cannot_write} ({e.strerror or e}); choose a writable folder") from e
        if not _try_lock(held):
            with held:
                raise _refusal(held, in_use)
        try:  # the file locked is still the one at `lock`, not one its last holder removed meanwhile
            current = os.stat(lock).st_ino == os.fstat(held.fileno()).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        held.close()
    with held:
        held.truncate(0)
        held.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        held.flush()
        try:
            yield
        finally:
            lock.unlink(missing_ok=True)  # while still held: see the check above
            for made_folder in made:  # a run that ended before it wrote anything leaves no folder behind
                try:
                    made_folder.rmdir()
                except OSError:  # not empty: the run's files
                    break


def check_model_out(out: Path, init_from: Path | None, model_entries: Collection[str],
                    inputs: dict[str, Iterable[Path | str | None]]) -> None:
    """Fail now when writing the model folder at `out` (replaced whole) would destroy what is not an
    earlier model folder: a file, an entry a model folder does not hold (`model_entries` are the names it
    may), the working folder, the --init-from folder, or a path of `inputs` (flag -> paths: the run's
    other files and folders) inside it."""
    out = Path(out)
    if out.name in ("", ".", ".."):
        raise WriteError(f"--out {out}: name the model folder to write (e.g. models/mine), not {out}")
    if init_from is not None and out.resolve() == Path(init_from).resolve():
        raise WriteError(f"--out {out} is the --init-from folder itself; write the new model to another folder")
    replaced = out.resolve()
    for flag, paths in {"the working folder": [Path.cwd()], **inputs}.items():
        for path in (Path(p) for p in paths if p is not None):
            if path.resolve().is_relative_to(replaced):  # the folder itself, or anything in it
                where = flag if flag == "the working folder" else f"{flag} {path}"
                raise WriteError(f"--out {out} holds {where}, which writing the model folder would delete (it "
                                 f"replaces --out whole); choose an --out outside it")
    if out.exists() and not out.is_dir():
        raise WriteError(f"--out {out} exists and is not a folder; refusing to replace it")
    if not out.is_dir():
        return
    foreign = sorted(p.name + ("/" if p.is_dir() else "") for p in out.iterdir() if p.name not in model_entries)
    if foreign:
        shown = first_few(foreign)
        kind = ("is not a model folder" if not (out / CONFIG_FILE).is_file()
                else "holds what a model folder does not")
        raise WriteError(f"--out {out} {kind} ({shown}); writing the model replaces --out whole, so it refuses: "
                         f"choose another folder, or move those out")


def first_few(names: list[str], shown: int = 3) -> str:
    """The first `shown` of `names` for a one-line message: "a, b, c and 4 more"."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def write_failed(path: Path, error: BaseException) -> WriteError:
    """`error`, raised while writing `path`, as one line. torch.save reports a full disk as a RuntimeError
    (the OSError is its context, or lost), safetensors in its message: all are looked at."""
    reason = None
    seen: BaseException | None = error
    while seen is not None and reason is None:
        if getattr(seen, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(seen):
            reason = "no space left on device"
        elif isinstance(seen, OSError) and seen.strerror:
            reason = seen.strerror
        seen = seen.__cause__ or seen.__context__
    if reason is None:
        reason = "no space left on device" if _almost_full(Path(path).parent) else str(error).splitlines()[0]
    return WriteError(f"{reason} writing {path}")


def _almost_full(folder: Path) -> bool:
    try:
        return shutil.disk_usage(folder).free < 1 << 20
    except OSError:
        return False


def process_alive(pid: int) -> bool:
    """Whether process `pid` runs (another user's counts); our own number is an earlier process's."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's
        return True
    return True


def temporary_sibling(dest: Path, suffix: str = "") -> Path:
    """A new folder beside `dest` (.NAME.PID.XXXX + suffix) in which `dest` is built before it is renamed
    into place; named for this process, so that a later run can tell it from a live one's."""
    return Path(tempfile.mkdtemp(prefix=_own_prefix(dest), suffix=suffix, dir=dest.parent))


def _own_prefix(dest: Path) -> str:
    """The name every temporary sibling of `dest` that this process makes starts with."""
    return f".{dest.name}.{os.getpid()}."


def remove_unfinished(dest: Path, tmp: Path | None, suffix: str = "") -> None:
    """After a failure or an interrupt while `dest` was built in `tmp` (temporary_sibling(dest, suffix)):
    remove `tmp`; when the interrupt came as temporary_sibling made it (`tmp` still None), this process's
    own such sibling, found by its name."""
    if tmp is None:
        prefix = _own_prefix(dest)
        parent = dest.parent
        own = [p for p in (parent.iterdir() if parent.is_dir() else [])
               if p.name.startswith(prefix) and p.name.endswith(suffix) and p.is_dir()]
    else:
        own = [tmp]
    for path in own:
        shutil.rmtree(path, ignore_errors=True)


def remove_stale_siblings(dest: Path, names: str | None = None) -> list[Path]:
    """Delete the temporary siblings of `dest` (.NAME.PID.*) that killed processes left, not a live one's;
    `names`, a regular expression: those of every NAME it matches, not `dest`'s alone."""
    pattern = re.compile(rf"^\.{names or re.escape(dest.name)}\.(\d+)\.")
    parent = dest.parent
    stale = [p for p in (parent.iterdir() if parent.is_dir() else [])
             if (m := pattern.match(p.name)) and p.is_dir() and not process_alive(int(m.group(1)))]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale
