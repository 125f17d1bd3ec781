"""What a model folder says about itself without loading it (JSON only, no torch): its trained length.

Shared by training (which records the length it trained at) and export (which serves that length).
"""
from __future__ import annotations

import json
from pathlib import Path

CONFIG_FILE = "config.json"
SBERT_CONFIG_FILE = "sentence_bert_config.json"  # sentence-transformers' Transformer module settings
TRAINING_SUMMARY_FILE = "training_summary.json"  # written by `python -m training.pretrain`
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
# Hugging Face writes int(1e30) as model_max_length when a tokenizer's length is unknown.
_UNKNOWN_LENGTH = 10**12


class ModelFolderInfoError(ValueError):
    """A JSON file of the model folder is unreadable or holds a length that is not a positive integer."""


def trained_max_length(folder: Path | str) -> int:
    """The longest sequence `folder`'s model was trained on, from the first of these that it has:
    sentence_bert_config.json `max_seq_length`; training_summary.json `max_length`, else the largest
    `phases[].max_seq_len`; tokenizer_config.json `model_max_length` (unless HF's "unknown"); config.json
    `max_position_embeddings`. Never more than max_position_embeddings."""
    positions = max_position_embeddings(folder)
    return min(positions, _declared_length(Path(folder)) or positions)


def max_position_embeddings(folder: Path | str) -> int:
    """config.json's max_position_embeddings: the longest sequence the weights can take at all."""
    path = Path(folder) / CONFIG_FILE
    positions = _length(_read(path, required=True), "max_position_embeddings", path)
    if positions is None:
        raise ModelFolderInfoError(f"{path} has no max_position_embeddings")
    return positions


def _declared_length(folder: Path) -> int | None:
    sbert = folder / SBERT_CONFIG_FILE
    if (n := _length(_read(sbert), "max_seq_length", sbert)) is not None:
        return n
    path = folder / TRAINING_SUMMARY_FILE
    summary = _read(path)
    if (n := _length(summary, "max_length", path)) is not None:
        return n
    phases = summary.get("phases") or []
    if not isinstance(phases, list) or not all(isinstance(p, dict) for p in phases):
        raise ModelFolderInfoError(f"{path}: phases is not a list of objects")
    phase_lengths = [n for p in phases if (n := _length(p, "max_seq_len", path)) is not None]
    if phase_lengths:
        return max(phase_lengths)
    path = folder / TOKENIZER_CONFIG_FILE
    n = _length(_read(path), "model_max_length", path, lenient=True)
    return n if n is not None and n < _UNKNOWN_LENGTH else None


def _read(path: Path, required: bool = False) -> dict:
    if not path.is_file():
        if required:
            raise ModelFolderInfoError(f"{path.parent}: no {path.name}")
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFolderInfoError(f"{path} is not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ModelFolderInfoError(f"{path} is not a JSON object")
    return data


def _length(d: dict, key: str, path: Path, lenient: bool = False) -> int | None:
    """d[key] as a positive int; None when absent or null. lenient: None for any other value too
    (tokenizer_config.json's model_max_length is often a float or absurd when unknown)."""
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, int) and not isinstance(v, bool) and v > 0:
        return v
    if lenient:
        return None
    raise ModelFolderInfoError(f"{path}: {key} is {v!r}, not a positive integer")
