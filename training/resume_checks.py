"""What --resume checks before it continues a checkpoint's run (the flags its state was made under, the
corpus, the tokenizer, whose --out it is), and paths and data settings as checkpoints record them."""
from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from training.checkpoint import CheckpointError
from training.corpus import CorpusError, resolve_corpus_files
from training.data import DataConfig
from training.wordpiece import fingerprint
from training.writes import first_few

# What --resume does with a flag given another value than the checkpoint's run had (--corpus: check_corpus).
# Refused: the flags that the checkpoint's weights, optimiser state and data position were made under, which
# another value would not continue exactly; phase 2's (and where it starts) once phase 2 has begun.
RESUME_FIXED = ("--text-field", "--vocab-size", "--vocab-file", "--no-lowercase", "--max-seq-len",
                "--max-predictions", "--masked-lm-prob", "--whole-word-masking", "--heldout-fraction",
                "--no-nsp-balance", "--preset", "--init-from", "--dropout", "--batch-size", "--seed")
RESUME_FIXED_IN_PHASE2 = ("--max-steps", "--phase2-seq-len", "--phase2-max-predictions", "--phase2-batch-size")
# Taken, and said at the start: how long the run goes on and how a step updates the weights (the
# learning-rate schedule is computed from these flags at every start). Every other flag says where files
# go, what is logged or evaluated, or on what hardware: taken as given.
RESUME_TAKEN = ("--phase2-steps", "--grad-accum", "--lr", "--warmup-steps", "--warmup-fraction", "--weight-decay",
                "--clip-norm")


def check_resume(path: Path, state: dict[str, Any], flags: dict[str, Any]) -> str:
    """Refuse in one line to resume the checkpoint `state` (read from `path`) with another value of a flag its
    state was made under (RESUME_FIXED), or with fewer steps than it has done. Returns the line that says
    which flags the run takes with new values ("" when none)."""
    step, in_phase2 = state["step"], state["phase"] > 0
    fixed = RESUME_FIXED + (RESUME_FIXED_IN_PHASE2 if in_phase2 else ())
    had = state.get("flags", {})  # {} in an older checkpoint: check_compatible compares its configuration
    changed = [f for f in fixed if f in had and had[f] != flags[f]]
    if changed:
        raise CheckpointError(
            f"checkpoint {path} was made with another configuration: "
            + ", ".join(f"{f} {_shown(had[f])} (now {_shown(flags[f])})" for f in changed)
            + "; its weights, optimiser state and data position hold only under those values: pass them to "
              "resume, or --fresh or another --run-dir to start over")
    flag = "--phase2-steps" if in_phase2 else "--max-steps"
    end = flags["--max-steps"] + (flags["--phase2-steps"] if in_phase2 else 0)
    if end < step:
        limit = f"--max-steps {flags['--max-steps']}" + (f" + --phase2-steps {flags[flag]}" if in_phase2 else "")
        raise CheckpointError(f"checkpoint {path} is at step {step}, past {limit}; pass {flag} "
                              f"{flags[flag] + step - end} or more to resume")
    taken = [f"{f} {_shown(flags[f])} (was {_shown(had[f])})" for f in flags
             if f not in fixed and f in had and had[f] != flags[f]]
    return f"resuming at step {step} with {', '.join(taken)}" if taken else ""


def check_tokenizer(path: Path, trained_with: Tokenizer, tokenizer: Tokenizer, cfg: DataConfig,
                    cache: str | None = None) -> None:
    """Refuse in one line to resume the checkpoint at `path` with `tokenizer`, which the settings `cfg` name or
    the prepared data in `cache` holds, where its weights were trained with `trained_with`: the same ids
    would mean other tokens."""
    if fingerprint(tokenizer) == fingerprint(trained_with):
        return
    if cfg.tokenizer_dir is not None:
        source, fix = f"--init-from {cfg.tokenizer_dir} has (its tokenizer changed since)", "restore that folder's"
    elif cfg.vocab_file is not None:
        source, fix = f"--vocab-file {cfg.vocab_file} gives (the file changed since)", "restore that file"
    else:  # a missing cache is prepared with the checkpoint's: this one was prepared by a run that trained its own
        source = f"the prepared data in {cache} holds (another run prepared it, with its own)"
        fix = "pass another --cache-dir to prepare the data again with the checkpoint's"
    raise CheckpointError(f"checkpoint {path} was trained with another tokenizer than {source}: the same ids would "
                          f"mean other tokens; {fix}, or --fresh or another --run-dir to start over")


def _shown(value: Any) -> str:
    """A flag's value in words: on / off for a switch, "not given" for one left out."""
    if value is None:
        return "not given"
    return ("on" if value else "off") if isinstance(value, bool) else str(value)


def paths_as_recorded_now(state: dict[str, Any]) -> dict[str, Any]:
    """`state` with its paths as checkpoints record them now: one written before holds the --corpus as it was
    spelt (a folder, a glob) and --vocab-file as typed, resolved here as the run's own are (a relative one
    from this working folder: the one it was typed in when the run resumes where it started)."""
    data, flags = state.get("data_config", {}), state.get("flags", {})
    try:
        corpus = corpus_files(data.get("corpus", []))
    except CorpusError:  # gone since: compared as recorded
        corpus = data.get("corpus", [])
    state = {**state, "data_config": {**data, "corpus": corpus, "vocab_file": absolute_path(data.get("vocab_file"))}}
    if "--vocab-file" in flags:
        state["flags"] = {**flags, "--vocab-file": absolute_path(flags["--vocab-file"])}
    return state


def check_same_out(path: Path, had: str | None, out: Path) -> None:
    """Refuse to resume, from the default run folder (runs/<--out's folder name>), the run of another --out
    that has the same folder name: it would continue that model's training into this one."""
    if had is not None and had != absolute_path(str(out)):
        raise CheckpointError(f"checkpoint {path} is of the run that writes {had}, not --out {out} (the default "
                              f"--run-dir is runs/<--out's folder name>); pass --run-dir to give this model a run "
                              f"folder of its own, or --out {had} to continue that run")


def check_corpus(path: Path, had: list[str], now: tuple[str, ...]) -> None:
    """Refuse a checkpoint of another corpus (other files, or the same in another order: another data
    order) in one line that says how they differ."""
    had, now = list(had), list(now)
    if had == now:
        return
    had_set, now_set = set(had), set(now)
    new, gone = [f for f in now if f not in had_set], [f for f in had if f not in now_set]
    if not new and not gone:
        # a shell sorts an unquoted glob by its locale; a quoted one is expanded here, sorted the same everywhere
        how = (f"the same {len(now)} files in another order (quote a glob, --corpus 'data/*.txt', to have it "
               f"read in one order)")
    else:
        how = f"{_files_in_words(now)} now against its {_files_in_words(had)}"
        for what, files in (("new", new), ("not given", gone)):
            if files:
                how += f"; {what}: {first_few(files, 1)}"
    raise CheckpointError(f"checkpoint {path} was made with another --corpus: {how}; pass the corpus it was made "
                          f"with, or --fresh or another --run-dir to start over")


_SAMPLE_BYTES = 64 * 1024


def corpus_contents(files: Sequence[str]) -> list[list]:
    """Each corpus file's size and a digest of its first and last 64 KB, which checkpoints record: a file
    changed in place since (text added, removed, or edited near either end) is then refused by --resume, not
    read at a data position that points at other sentences. A copy or a move keeps them, unlike the time."""
    contents = []
    for name in files:
        try:
            with open(name, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                digest = hashlib.sha256(f.read(_SAMPLE_BYTES))
                if size > _SAMPLE_BYTES:
                    f.seek(max(_SAMPLE_BYTES, size - _SAMPLE_BYTES))
                    digest.update(f.read(_SAMPLE_BYTES))
        except OSError as e:
            raise CorpusError(f"cannot read corpus file {name}: {e.strerror or e}") from e
        contents.append([size, digest.hexdigest()[:16]])
    return contents


def check_corpus_contents(path: Path, had: list | None, now: list, files: Sequence[str]) -> None:
    """Refuse a checkpoint whose corpus files (the same ones: check_corpus) have changed since, naming the
    first; a checkpoint from before contents were recorded (`had` None) is taken."""
    for name, then, current in zip(files, had or [], now):
        if list(then) != list(current):
            change = (f"{then[0]} bytes then, {current[0]} now" if then[0] != current[0] else
                      "the same size, other bytes")
            raise CheckpointError(f"checkpoint {path} was made from other contents of {name} ({change}): its data "
                                  f"position would now point at other sentences; resume with the file as it was, or "
                                  f"pass --fresh or another --run-dir to start over")


def _files_in_words(files: list[str]) -> str:
    return f"{len(files)} file{'s' if len(files) != 1 else ''}" if files else "the embedded default corpus"


def corpus_files(corpus: list[str] | tuple[str, ...]) -> list[str]:
    """The files a --corpus names, absolute, in reading order; none for the embedded default corpus."""
    return [str(f) for f in resolve_corpus_files(corpus)] if corpus else []


def absolute_path(path: str | None) -> str | None:
    """A path as checkpoints record and compare it: absolute and normalised, so that a run resumes from any
    working folder."""
    return None if path is None else str(Path(path).expanduser().resolve())


# How the held-out split is made, as checkpoints record it (comparable): held-out documents less their
# sentences that training documents also hold (training.data.unseen_spans). Checkpoints from before record none.
HELDOUT_SPLIT = "documents less sentences in training"


def heldout_split_notice(path: Path, state: dict[str, Any]) -> str | None:
    """A line for a checkpoint made before the held-out split left out the sentences that training documents
    also hold (it records no split), which resumes as it was: its training data and pairs are the same, and
    only the held-out figures change text where it resumes. Its data settings then count as of this split
    (another split it records is refused with the other settings, check_compatible). None otherwise."""
    data = state["data_config"]
    if "heldout_split" in data:
        return None
    data["heldout_split"] = HELDOUT_SPLIT
    return (f"checkpoint {path} was made before the held-out split left out the sentences that training documents "
            f"also hold: its held-out figures up to step {state.get('step', '?')} were scored partly on text the "
            f"model trained on, and from here on they are not, so expect them to drop there")


def comparable(c: DataConfig) -> dict[str, Any]:
    """The data settings that decide what the model sees (the cache location does not), and how the held-out
    split is made."""
    d = asdict(c)
    d["heldout_split"] = HELDOUT_SPLIT
    d.pop("cache_dir", None)
    if d["text_field"] == "text":  # the default, as checkpoints from before the setting record it: not at all
        del d["text_field"]
    d["corpus"] = [str(x) for x in d["corpus"]]
    return d
