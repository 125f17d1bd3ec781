"""The JSON facts of a model folder (ours, or a Hugging Face / sentence-transformers BERT folder) that
training and export both read: where its transformer lives and the longest sequence it was trained at.
Dependency-free (no torch), like the rest of `artifact`.
"""
from __future__ import annotations

import json
from pathlib import Path

from artifact.manifest import TRUNCATION_DIRECTIONS

CONFIG_FILE = "config.json"
TRAINING_SUMMARY_FILE = "training_summary.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SENTENCE_BERT_CONFIG_FILE = "sentence_bert_config.json"
MODULES_FILE = "modules.json"
SBERT_MODEL_CONFIG_FILE = "config_sentence_transformers.json"
# The module class, by its name: sentence-transformers < 6 writes "sentence_transformers.models.Transformer",
# 6 "sentence_transformers.base.modules.transformer.Transformer".
_TRANSFORMER_MODULE = "Transformer"
# BERT's own default, when config.json does not say.
DEFAULT_MAX_POSITIONS = 512


class ModelFolderError(ValueError):
    """A model folder that is missing, incomplete or corrupt; the message says what to do."""


def _read_json(path: Path) -> object:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFolderError(f"{path} is not valid JSON ({e}); the folder is corrupt, re-create it") from e


def _json_object(path: Path) -> dict:
    """The file's object; {} when it is absent or holds something else."""
    data = _read_json(path) if path.is_file() else {}
    return data if isinstance(data, dict) else {}


def transformer_folder(folder: Path | str) -> Path:
    """Where config.json, the weights and the tokenizer are: `folder` itself, or, in a
    sentence-transformers folder, the `path` of the Transformer module in modules.json (often "" and
    sometimes `0_Transformer`)."""
    folder = Path(folder)
    modules = folder / MODULES_FILE
    if not modules.is_file():
        return folder
    entries = _read_json(modules)
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and str(entry.get("type", "")).rsplit(".", 1)[-1] == _TRANSFORMER_MODULE:
            return folder / str(entry.get("path", ""))
    raise ModelFolderError(f"{modules} names no {_TRANSFORMER_MODULE} module; not a BERT sentence encoder")


def _positive_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def trained_max_length(folder: Path | str) -> int:
    """The longest sequence (in tokens, [CLS] and [SEP]s included) the model in `folder` was trained at,
    never more than its max_position_embeddings. The first of, in the transformer folder:

    1. training_summary.json `max_length` (ours; older summaries: the longest phase's max_seq_len);
    2. sentence_bert_config.json `max_seq_length` (sentence-transformers);
    3. tokenizer_config.json `model_max_length`, unless HF's "unknown" value (int(1e30)) or not a positive int;
    4. config.json `max_position_embeddings` (512 when absent).
    """
    positions = max_position_embeddings(folder)
    return min(_recorded_length(transformer_folder(folder)) or positions, positions)


def max_position_embeddings(folder: Path | str) -> int:
    """config.json's max_position_embeddings: the longest sequence the weights can take at all."""
    folder = transformer_folder(folder)
    config_path = folder / CONFIG_FILE
    if not config_path.is_file():
        raise ModelFolderError(f"{folder}: no {CONFIG_FILE}; not a model folder (expected one written by "
                               f"`python -m training.pretrain` or a Hugging Face BERT checkpoint)")
    return _positive_int(_json_object(config_path).get("max_position_embeddings")) or DEFAULT_MAX_POSITIONS


def _declared(folder: Path, name: str, key: str) -> int | None:
    """A length the folder states on purpose: absent or null is None; anything but a positive int is an error."""
    path = folder / name
    value = _json_object(path).get(key)
    if value is None:
        return None
    if _positive_int(value) is None:
        raise ModelFolderError(f"{path}: {key} is {value!r}, not a positive integer")
    return value


def _recorded_length(folder: Path) -> int | None:
    summary = _json_object(folder / TRAINING_SUMMARY_FILE)
    phases = summary.get("phases") if isinstance(summary.get("phases"), list) else []
    phases = [_positive_int(p.get("max_seq_len")) for p in phases if isinstance(p, dict)]
    found = (_declared(folder, TRAINING_SUMMARY_FILE, "max_length") or max(filter(None, phases), default=None)
             or _declared(folder, SENTENCE_BERT_CONFIG_FILE, "max_seq_length"))
    if found:
        return found
    found = _positive_int(_json_object(folder / TOKENIZER_CONFIG_FILE).get("model_max_length"))
    return found if found and found < 10**9 else None  # transformers writes int(1e30) when it does not know


def truncation_side(folder: Path | str) -> str:
    """Which end transformers' tokenizer of `folder` cuts an over-long input at when asked to truncate:
    tokenizer_config.json `truncation_side` (right when absent), which `tokenizer(a, b, truncation=True)`,
    CrossEncoder.predict and SentenceTransformer.encode follow."""
    path = transformer_folder(folder) / TOKENIZER_CONFIG_FILE
    side = _json_object(path).get("truncation_side")
    if side is None:
        return "right"
    if side not in TRUNCATION_DIRECTIONS:
        raise ModelFolderError(f"{path}: truncation_side is {side!r}, not one of {', '.join(TRUNCATION_DIRECTIONS)}")
    return side
