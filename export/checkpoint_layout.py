"""Where a model folder's encoder lives and how its makers meant its vectors made: a sentence-transformers
folder's modules.json (Transformer -> Pooling -> any Dense -> optional Normalize), or, for any other BERT
folder, the raw [CLS] vector. Reads JSON (and the Dense modules' weights); whatever the server could not
reproduce is an ExportError."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from artifact.source_folder import MODULES_FILE, SBERT_MODEL_CONFIG_FILE
from artifact.source_folder import SENTENCE_BERT_CONFIG_FILE as SBERT_CONFIG_FILE
from export import ExportError
from training import bert_family
from training.model_folder import read_state_dict

MODULE_CONFIG_FILE = "config.json"  # a Pooling / Normalize module's settings, in its own folder
# Pooling config keys of sentence-transformers < 5 (booleans; several true = concatenated) -> our names.
_LEGACY_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                 "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
                 "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
# sentence-transformers >= 5 names its modes in `pooling_mode` (a name, or a list to concatenate).
_MODES = {"cls": "cls", "max": "max", "mean": "mean", "mean_sqrt_len_tokens": "mean_sqrt_len",
          "weightedmean": "weightedmean", "lasttoken": "lasttoken"}
# A Dense module's activation_function (a torch class path) -> artifact.manifest.DENSE_ACTIVATIONS
_ACTIVATIONS = {"Tanh": "tanh", "Identity": "identity", "ReLU": "relu", "Sigmoid": "sigmoid", "GELU": "gelu"}


@dataclass(frozen=True)
class DenseLayer:
    """A sentence-transformers Dense module: activation(vector @ weight.T + bias)."""
    weight: np.ndarray  # float32 [out_features, in_features]
    bias: np.ndarray | None  # float32 [out_features]
    activation: str


@dataclass(frozen=True)
class CheckpointLayout:
    encoder_dir: Path  # config.json, weights and tokenizer of the BERT encoder
    pooling: str  # one of artifact.manifest.POOLINGS
    normalize: bool
    lowercase: bool  # the makers lower-case texts before tokenising (sentence_bert_config's do_lower_case)
    dense: tuple[DenseLayer, ...] = ()  # after the pooling, before Normalize
    prompts: dict[str, str] = field(default_factory=dict)  # name -> text put before a text (query: "query: ")
    default_prompt_name: str | None = None  # the prompt sentence-transformers puts before every text unasked


def read_layout(model_dir: Path) -> CheckpointLayout:
    modules_path = model_dir / MODULES_FILE
    if not modules_path.is_file():
        return CheckpointLayout(model_dir, "cls", False, False)
    kind, prompts, default_prompt_name = _read_model_config(model_dir)
    modules = _read_json(modules_path)
    if not isinstance(modules, list) or not all(isinstance(m, dict) and "type" in m for m in modules):
        raise ExportError(f"{modules_path} is not a list of modules with a type each")
    modules = sorted(modules, key=lambda m: m.get("idx", 0))
    kinds = [str(m["type"]).rsplit(".", 1)[-1] for m in modules]
    if kind == "CrossEncoder":  # its Transformer is a BertForSequenceClassification: scores, not vectors
        if kinds != ["Transformer"]:
            raise ExportError(f"{modules_path}: a CrossEncoder of {' -> '.join(kinds)}; the server runs one "
                              f"Transformer module")
        return CheckpointLayout(_module_dir(model_dir, modules[0]), "cls", False, False)
    for module, kind in zip(modules, kinds):
        if kind not in ("Transformer", "Pooling", "Dense", "Normalize"):
            raise ExportError(f"{modules_path}: module {module.get('path') or module.get('name')!r} is a {kind}, "
                              f"which the server does not run (it runs Transformer, Pooling, Dense and Normalize)")
    normalize = kinds[-1] == "Normalize"
    n_dense = len(kinds) - 2 - normalize
    if kinds[:2] != ["Transformer", "Pooling"] or kinds[2:len(kinds) - normalize] != ["Dense"] * n_dense:
        raise ExportError(f"{modules_path} chains {' -> '.join(kinds)}; the server reproduces Transformer -> "
                          f"Pooling, then any Dense, optionally -> Normalize")
    encoder_dir = _module_dir(model_dir, modules[0])
    sbert = _read_object(encoder_dir / SBERT_CONFIG_FILE) if (encoder_dir / SBERT_CONFIG_FILE).is_file() else {}
    task = sbert.get("transformer_task", "feature-extraction")
    if task != "feature-extraction":
        raise ExportError(f"{encoder_dir / SBERT_CONFIG_FILE}: transformer_task {task!r}; the server serves "
                          f"feature-extraction (token vectors) only")
    pooling_dir = _module_dir(model_dir, modules[1])
    width = _hidden_size(encoder_dir)
    pooling = _pooling_mode(pooling_dir / MODULE_CONFIG_FILE, width, bool(prompts))
    dense = []
    for module in modules[2:2 + n_dense]:
        dense.append(_dense_layer(_module_dir(model_dir, module), width))
        width = dense[-1].weight.shape[0]
    if normalize:
        _check_normalize(_module_dir(model_dir, modules[-1]) / MODULE_CONFIG_FILE)
    return CheckpointLayout(encoder_dir, pooling, normalize, bool(sbert.get("do_lower_case", False)), tuple(dense),
                            prompts, default_prompt_name)


def _read_model_config(model_dir: Path) -> tuple[str, dict[str, str], str | None]:
    """The model's type (SentenceTransformer or CrossEncoder; a SparseEncoder is refused), its prompts and
    the default one, from config_sentence_transformers.json."""
    path = model_dir / SBERT_MODEL_CONFIG_FILE
    if not path.is_file():
        return "SentenceTransformer", {}, None
    config = _read_object(path)
    kind = config.get("model_type", "SentenceTransformer")
    if kind not in ("SentenceTransformer", "CrossEncoder"):
        raise ExportError(f"{path}: model_type {kind!r}; the server serves SentenceTransformer and CrossEncoder "
                          f"models")
    prompts = config.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()):
        raise ExportError(f"{path}: prompts is not an object of names to texts")
    default = config.get("default_prompt_name") or None
    if default is not None and default not in prompts:
        raise ExportError(f"{path}: default_prompt_name {default!r} is not one of its prompts "
                          f"({', '.join(prompts) or 'none'})")
    return kind, prompts, default


def _module_dir(model_dir: Path, module: dict) -> Path:
    path = model_dir / str(module.get("path") or "")
    if not path.is_dir() and module["type"].rsplit(".", 1)[-1] != "Normalize":  # old Normalize: no folder
        raise ExportError(f"{model_dir / MODULES_FILE} names the module folder {module.get('path')!r}, "
                          f"which does not exist")
    return path


def _pooling_mode(path: Path, hidden_size: int, has_prompts: bool) -> str:
    config = _read_object(path)
    if has_prompts and config.get("include_prompt", True) is False:  # INSTRUCTOR-like models
        raise ExportError(f"{path}: include_prompt is false (the pooling leaves a prompt's tokens out), which the "
                          f"server does not do")
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


def _dense_layer(folder: Path, in_width: int) -> DenseLayer:
    """A Dense module's config.json and weights (model.safetensors, or pytorch_model.bin of older
    sentence-transformers), checked against the width that comes into it."""
    config = _read_object(folder / MODULE_CONFIG_FILE)
    name = str(config.get("activation_function", "torch.nn.modules.activation.Tanh")).rsplit(".", 1)[-1]
    if name not in _ACTIVATIONS:
        raise ExportError(f"{folder / MODULE_CONFIG_FILE}: activation_function {config['activation_function']!r} "
                          f"is not one the server runs ({', '.join(_ACTIVATIONS)})")
    if config.get("in_features") != in_width:
        raise ExportError(f"{folder / MODULE_CONFIG_FILE}: in_features {config.get('in_features')!r}, but "
                          f"{in_width}-wide vectors come into it")
    tensors = {k: v.float().numpy() for k, v in read_state_dict(folder).items()}  # ModelFolderError if unreadable
    weight, bias = tensors.get("linear.weight"), tensors.get("linear.bias")
    out_width = config.get("out_features")
    if weight is None or weight.shape != (out_width, in_width) or (
            (bias is not None) != bool(config.get("bias", True)) or (bias is not None and bias.shape != (out_width,))):
        raise ExportError(f"{folder}: the weights are not those of a {in_width} -> {out_width} Dense module "
                          f"(linear.weight {None if weight is None else tuple(weight.shape)}, linear.bias "
                          f"{None if bias is None else tuple(bias.shape)})")
    return DenseLayer(weight, bias, _ACTIVATIONS[name])


def _check_normalize(path: Path) -> None:
    """Old sentence-transformers saved Normalize without a config (it normalises the sentence vector)."""
    config = _read_object(path) if path.is_file() else {}
    names = (config.get("module_input_name", "sentence_embedding"), config.get("module_output_name", "sentence_embedding"))
    if names != ("sentence_embedding", "sentence_embedding"):
        raise ExportError(f"{path}: Normalize maps {names[0]} to {names[1]}; the server normalises only the "
                          f"sentence embedding")


def _hidden_size(encoder_dir: Path) -> int:
    try:
        return int(bert_family.bert_config(_read_object(encoder_dir / "config.json")).get("hidden_size", -1))
    except ValueError as e:  # a family member the server cannot reproduce, in its reader's words
        raise ExportError(f"{encoder_dir / 'config.json'}: {e}") from e


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
