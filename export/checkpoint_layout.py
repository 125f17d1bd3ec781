"""Where a model folder's encoder lives and how its makers meant its vectors made: a sentence-transformers
folder's modules.json (Transformer -> Pooling -> optional Normalize), or, for any other BERT folder, the raw
[CLS] vector. Reads JSON only; whatever the server could not reproduce is an ExportError."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from artifact.source_folder import SENTENCE_BERT_CONFIG_FILE as SBERT_CONFIG_FILE
from export import ExportError

MODULES_FILE = "modules.json"
SBERT_MODEL_CONFIG_FILE = "config_sentence_transformers.json"
MODULE_CONFIG_FILE = "config.json"  # a Pooling / Normalize module's settings, in its own folder
# Pooling config keys of sentence-transformers < 5 (booleans; several true = concatenated) -> our names.
_LEGACY_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
                 "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
# sentence-transformers >= 5 names its modes in `pooling_mode` (a name, or a list to concatenate).
_MODES = {"cls": "cls", "max": "max", "mean": "mean", "mean_sqrt_len_tokens": "mean_sqrt_len",
          "weightedmean": "weightedmean", "lasttoken": "lasttoken"}


@dataclass(frozen=True)
class CheckpointLayout:
    encoder_dir: Path  # config.json, weights and tokenizer of the BERT encoder
    pooling: str  # one of artifact.manifest.POOLINGS
    normalize: bool
    lowercase: bool  # the makers lower-case texts before tokenising (sentence_bert_config's do_lower_case)


def read_layout(model_dir: Path) -> CheckpointLayout:
    modules_path = model_dir / MODULES_FILE
    if not modules_path.is_file():
        return CheckpointLayout(model_dir, "cls", False, False)
    _check_model_type(model_dir)
    modules = _read_json(modules_path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) and "type" in m for m in modules):
        raise ExportError(f"{modules_path} is not a list of modules with a type each")
    modules = sorted(modules, key=lambda m: m.get("idx", 0))
    kinds = [str(m["type"]).rsplit(".", 1)[-1] for m in modules]
    for module, kind in zip(modules, kinds):
        if kind not in ("Transformer", "Pooling", "Normalize"):
            raise ExportError(f"{modules_path}: module {module.get('path') or module.get('name')!r} is a {kind}, "
                              f"which the server does not run (it runs Transformer, Pooling and Normalize only)")
    if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        raise ExportError(f"{modules_path} chains {' -> '.join(kinds)}; the server reproduces Transformer -> "
                          f"Pooling, optionally -> Normalize")
    encoder_dir = _module_dir(model_dir, modules[0])
    sbert = _read_object(encoder_dir / SBERT_CONFIG_FILE) if (encoder_dir / SBERT_CONFIG_FILE).is_file() else {}
    task = sbert.get("transformer_task", "feature-extraction")
    if task != "feature-extraction":
        raise ExportError(f"{encoder_dir / SBERT_CONFIG_FILE}: transformer_task {task!r}; the server serves "
                          f"feature-extraction (token vectors) only")
    pooling_dir = _module_dir(model_dir, modules[1])
    pooling = _pooling_mode(pooling_dir / MODULE_CONFIG_FILE, _hidden_size(encoder_dir))
    if len(modules) == 3:
        _check_normalize(_module_dir(model_dir, modules[2]) / MODULE_CONFIG_FILE)
    return CheckpointLayout(encoder_dir, pooling, len(modules) == 3, bool(sbert.get("do_lower_case", False)))


def _check_model_type(model_dir: Path) -> None:
    """A SparseEncoder or CrossEncoder folder also has modules.json; and a default prompt would be
    prepended to every text by sentence-transformers, which the server does not do."""
    path = model_dir / SBERT_MODEL_CONFIG_FILE
    if not path.is_file():
        return
    config = _read_object(path)
    kind = config.get("model_type", "SentenceTransformer")
    if kind != "SentenceTransformer":
        raise ExportError(f"{path}: model_type {kind!r}; the server serves SentenceTransformer models only")
    if config.get("default_prompt_name"):
        raise ExportError(f"{path}: sentence-transformers prepends the prompt {config['default_prompt_name']!r} "
                          f"to every text by default, which the server does not do")


def _module_dir(model_dir: Path, module: dict) -> Path:
    path = model_dir / str(module.get("path") or "")
    if not path.is_dir() and module["type"].rsplit(".", 1)[-1] != "Normalize":  # old Normalize: no folder
        raise ExportError(f"{model_dir / MODULES_FILE} names the module folder {module.get('path')!r}, "
                          f"which does not exist")
    return path


def _pooling_mode(path: Path, hidden_size: int) -> str:
    # include_prompt matters only when a prompt is prepended, which the server never does (_check_model_type).
    config = _read_object(path)
    width = config.get("embedding_dimension", config.get("word_embedding_dimension"))
    if width != hidden_size:
        raise ExportError(f"{path}: the Pooling module expects {width}-wide token vectors but the encoder's "
                          f"hidden size is {hidden_size}")
    if "pooling_mode" in config:
        named = config["pooling_mode"]
        names = [named] if isinstance(named, str) else list(named or [])
        unknown = [n for n in names if n not in _MODES]
        if unknown:
            raise ExportError(f"{path}: pooling_mode {unknown[0]!r} is not one the server knows "
                              f"({', '.join(_MODES)})")
        modes = [_MODES[n] for n in names]
    elif any(key in config for key in _LEGACY_MODES):
        modes = [mode for key, mode in _LEGACY_MODES.items() if config.get(key)]
    else:  # sentence-transformers' default, in every version
        modes = ["mean"]
    if len(modes) != 1:
        what = "sets no pooling mode" if not modes else f"concatenates {len(modes)} poolings ({' + '.join(modes)})"
        raise ExportError(f"{path} {what}; the server serves exactly one")
    return modes[0]


def _check_normalize(path: Path) -> None:
    """Old sentence-transformers saved Normalize without a config (it normalises the sentence vector)."""
    config = _read_object(path) if path.is_file() else {}
    names = (config.get("module_input_name", "sentence_embedding"), config.get("module_output_name", "sentence_embedding"))
    if names != ("sentence_embedding", "sentence_embedding"):
        raise ExportError(f"{path}: Normalize maps {names[0]} to {names[1]}; the server normalises only the "
                          f"sentence embedding")


def _hidden_size(encoder_dir: Path) -> int:
    return int(_read_object(encoder_dir / "config.json").get("hidden_size", -1))


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as e:
        raise ExportError(f"{path.parent}: no {path.name}") from e
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ExportError(f"{path} is not valid JSON ({e})") from e


def _read_object(path: Path) -> dict:
    data = _read_json(path)
    if not isinstance(data, dict):
        raise ExportError(f"{path} is not a JSON object")
    return data
