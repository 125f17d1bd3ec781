"""Reads and writes the model folder: config.json + model.safetensors + tokenizer files.

The folder is the hand-off from training to export. Ours is written atomically (a temporary sibling
renamed into place) and is also a valid Hugging Face BERT checkpoint; reading accepts any local
`BertModel` / `BertForPreTraining` checkpoint (safetensors or a PyTorch .bin), sentence-transformers
folders included, with the key spellings transformers itself accepts (`LayerNorm.gamma` / `.beta`).
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from artifact.source_folder import (CONFIG_FILE, MODULES_FILE, SBERT_MODEL_CONFIG_FILE, SENTENCE_BERT_CONFIG_FILE,
                                    TOKENIZER_CONFIG_FILE, TRAINING_SUMMARY_FILE, transformer_folder)
from artifact.source_folder import ModelFolderError  # noqa: F401 (raised here; callers import it from here)
from training import bert_family
from training.model import BertConfig, BertForPreTraining
from training.writes import remove_stale_siblings, remove_unfinished, temporary_sibling, write_failed

WEIGHTS_FILE = "model.safetensors"
TORCH_WEIGHTS_FILE = "pytorch_model.bin"
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json")

# Tied to the word embeddings (and its bias to cls.predictions.bias): never stored separately.
_TIED_KEYS = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")
# Buffers that transformers versions stored with the weights; ours are rebuilt from the config.
_BUFFER_SUFFIXES = ("embeddings.position_ids", "embeddings.token_type_ids")
# The heads of fine-tuned BERTs (sequence / token classification and multiple choice, question answering):
# named in the error, since "unexpected tensors" alone does not say that the checkpoint is a cross-encoder.
_TASK_HEADS = ("classifier.", "qa_outputs.")
# Old (TF-converted) checkpoints, such as Google's bert-base-uncased, renamed as transformers does at load.
_LEGACY_NAMES = {"LayerNorm.gamma": "LayerNorm.weight", "LayerNorm.beta": "LayerNorm.bias"}


@dataclass
class LoadedModel:
    model: BertForPreTraining
    config: BertConfig
    has_mlm_head: bool
    has_pooler: bool
    has_nsp_head: bool
    folder: Path
    # A BertForSequenceClassification's head on the pooler (read only when asked for), and its labels.
    classifier: torch.nn.Linear | None = None
    classifier_labels: tuple[str, ...] = ()
    # The checkpoint's MLM decoder is its own weight, not its word embeddings (tie_word_embeddings false): the
    # loaded model's decoder is the embeddings, so its MLM scores are not the checkpoint's.
    untied_mlm_decoder: bool = False
    # How its logits are scored (artifact.manifest.CLASSIFIER_SCORINGS), from config.json's problem_type.
    scoring: str = "auto"


def sentence_transformers_files(folder: Path | str) -> dict[str, Path | str]:
    """What else makes `folder` a sentence-transformers model (its Pooling / Normalize modules and settings),
    for the folder a model trained from it is written to: name -> file or folder to copy, or text to write.
    modules.json is rewritten with the Transformer at the root, where training writes the weights, so that
    export serves the trained model with the pooling its makers chose. {} for any other folder."""
    folder = Path(folder)
    if not (folder / MODULES_FILE).is_file():
        return {}
    modules = json.loads((folder / MODULES_FILE).read_text())
    transformer = transformer_folder(folder)
    found: dict[str, Path | str] = {}
    for module in modules:
        if str(module.get("type", "")).endswith(".Transformer"):
            module["path"] = ""
        elif module.get("path") and (folder / module["path"]).exists():
            found[module["path"]] = folder / module["path"]
    for name in (SENTENCE_BERT_CONFIG_FILE, SBERT_MODEL_CONFIG_FILE):
        source = next((d / name for d in (transformer, folder) if (d / name).is_file()), None)
        if source is not None:
            found[name] = source
    found[MODULES_FILE] = json.dumps(modules, indent=2) + "\n"
    return found


def model_folder_entries(folder: Path | str) -> set[str]:
    """The names save_model_folder may write in a folder: what retraining into `folder` may replace. A
    sentence-transformers module folder counts where the folder's own modules.json names it."""
    names = {CONFIG_FILE, WEIGHTS_FILE, *TOKENIZER_FILES, TRAINING_SUMMARY_FILE, MODULES_FILE,
             SENTENCE_BERT_CONFIG_FILE, SBERT_MODEL_CONFIG_FILE}
    try:
        modules = json.loads((Path(folder) / MODULES_FILE).read_text())
        names |= {str(m["path"]).split("/")[0] for m in modules if isinstance(m, dict) and m.get("path")}
    except (OSError, ValueError, TypeError):
        pass  # no modules.json, or one that is not ours: no module folder is ours either
    return names


def save_model_folder(
    model: BertForPreTraining, tokenizer_dir: Path, out_dir: Path, extra_files: dict[str, dict] | None = None,
    max_length: int | None = None, copies: dict[str, Path | str] | None = None,
) -> Path:
    """Write config, weights, tokenizer files (copied from `tokenizer_dir`) and any extra JSON files;
    `max_length` (the longest sequence trained at) becomes tokenizer_config.json's model_max_length, and a
    copied sentence_bert_config.json's max_seq_length; `copies` (see sentence_transformers_files) are
    copied or written as they are otherwise.
    Nothing appears at `out_dir` until everything is written."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_siblings(out_dir)  # what a killed run left
    tmp = None
    try:
        tmp = temporary_sibling(out_dir)
        (tmp / CONFIG_FILE).write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
        state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items() if k not in _TIED_KEYS}
        save_file(state, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        for name in TOKENIZER_FILES:
            src = Path(tokenizer_dir) / name
            if src.exists():
                shutil.copy2(src, tmp / name)
        if max_length is not None:
            path = tmp / TOKENIZER_CONFIG_FILE
            config = json.loads(path.read_text()) if path.is_file() else {}
            path.write_text(json.dumps({**config, "model_max_length": max_length}, indent=2) + "\n")
        for name, payload in (extra_files or {}).items():
            (tmp / name).write_text(json.dumps(payload, indent=2) + "\n")
        for name, source in (copies or {}).items():
            if isinstance(source, str):
                (tmp / name).write_text(source)
            elif source.is_dir():
                shutil.copytree(source, tmp / name)
            else:
                shutil.copy2(source, tmp / name)
        sbert_config = tmp / SENTENCE_BERT_CONFIG_FILE
        if max_length is not None and sbert_config.is_file():
            # sentence-transformers cuts texts at this length where it is given: the length the server takes
            config = json.loads(sbert_config.read_text())
            if config.get("max_seq_length") is not None:
                sbert_config.write_text(json.dumps({**config, "max_seq_length": max_length}, indent=2) + "\n")
        # mkdtemp makes the folder private: a model folder is meant to be read by others (a server user,
        # a teammate), as export leaves its artifact folders
        for path in (tmp, *tmp.rglob("*")):
            path.chmod(0o755 if path.is_dir() else 0o644)
        _replace_dir(tmp, out_dir)
    except BaseException as e:
        failure = write_failed(out_dir, e) if isinstance(e, (OSError, RuntimeError, SafetensorError)) else None
        remove_unfinished(out_dir, tmp)
        if failure is not None:
            raise failure from e
        raise
    return out_dir


def _replace_dir(src: Path, dst: Path) -> None:
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(dst, old)
        try:
            os.replace(src, dst)
        except BaseException:
            os.replace(old, dst)  # put the earlier model back rather than leave neither in place
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


def read_config(folder: Path) -> BertConfig:
    return _bert_config(folder, _config_json(folder))


def _config_json(folder: Path) -> dict:
    path = Path(folder) / CONFIG_FILE
    if not path.is_file():
        raise ModelFolderError(f"{folder}: no {CONFIG_FILE}; not a model folder (expected one written by "
                               f"`python -m training.pretrain` or a Hugging Face BERT checkpoint)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFolderError(f"{path} is not valid JSON ({e}); the folder is corrupt, re-create it") from e
    if not isinstance(raw, dict):
        raise ModelFolderError(f"{path} holds a JSON {type(raw).__name__}, not an object of settings; the folder "
                               f"is corrupt, re-create it")
    return raw


# The settings that decide the weights' shapes: where config.json leaves one out, BERT-base's value is
# taken (as transformers does), and weights of another shape then look wrong when the config is.
_SHAPE_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
               "max_position_embeddings", "type_vocab_size")


def _defaults_taken(raw_config: dict) -> str:
    """What to add to a message blaming the weights when config.json left out shape settings."""
    try:
        given = bert_family.bert_config(raw_config)
    except (TypeError, ValueError):  # a config that is wrong in other ways: its own message says so
        return ""
    left_out = [k for k in _SHAPE_KEYS if given.get(k) is None]
    if not left_out:
        return ""
    defaults = BertConfig()
    return (f"; config.json leaves out {', '.join(left_out)}, so BERT-base's "
            f"{', '.join(str(getattr(defaults, k)) for k in left_out)} was taken: give the model's own")


def _shape_mismatch(model: BertForPreTraining, state: dict[str, torch.Tensor]) -> str:
    """The first tensor whose shape in the weights differs from the config's, and how many do, in words."""
    wrong = [(k, list(v.shape), list(state[k].shape)) for k, v in model.state_dict().items()
             if k in state and state[k].shape != v.shape]
    if not wrong:
        return "they do not load"
    name, wanted, found = wrong[0]
    return (f"{len(wrong)} tensors have another shape than config.json gives (e.g. {name}: {found} in the "
            f"weights, {wanted} by config.json)")


def _bert_config(folder: Path, raw: dict) -> BertConfig:
    try:
        return BertConfig.from_hf_dict(bert_family.bert_config(raw))
    except (TypeError, ValueError) as e:
        raise ModelFolderError(f"{Path(folder) / CONFIG_FILE}: {e}{_defaults_taken(raw)}") from e


def weights_files(folder: Path) -> list[Path]:
    """The files `folder`'s weights are in: model.safetensors, else pytorch_model.bin, else the shards that
    model.safetensors.index.json (or pytorch_model.bin.index.json) names, as transformers saves a model
    past its max_shard_size; ModelFolderError in one line when there are none."""
    folder = Path(folder)
    for single in (WEIGHTS_FILE, TORCH_WEIGHTS_FILE):
        if (folder / single).is_file():
            return [folder / single]
    for single in (WEIGHTS_FILE, TORCH_WEIGHTS_FILE):
        index = folder / f"{single}.index.json"
        if not index.is_file():
            continue
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelFolderError(f"{index} could not be read as a shard index ({e}); re-create or re-download "
                                   f"it") from e
        if outside := [name for name in shards if Path(name).name != name or name in ("", ".", "..")]:
            raise ModelFolderError(f"{index} names a shard outside the folder ({outside[0]!r}); re-create or "
                                   f"re-download it")
        if missing := [name for name in shards if not (folder / name).is_file()]:
            raise ModelFolderError(f"{folder} lacks {missing[0]}, a shard that {index.name} names"
                                   + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        return [folder / name for name in shards]
    raise ModelFolderError(f"{folder}: no {WEIGHTS_FILE} or {TORCH_WEIGHTS_FILE} found (nor a sharded "
                           f"{WEIGHTS_FILE}.index.json)")


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """The tensors of `folder`'s weights (weights_files); ModelFolderError in one line."""
    state: dict[str, torch.Tensor] = {}
    for path in weights_files(folder):
        try:
            if path.name.endswith(".safetensors"):
                state.update(load_file(str(path)))
            else:
                state.update(torch.load(str(path), map_location="cpu", weights_only=True))
        except (SafetensorError, RuntimeError, OSError, EOFError, ValueError) as e:
            raise ModelFolderError(f"{path} could not be read ({type(e).__name__}: {e}); the weights are "
                                   f"corrupt or truncated, re-create or re-download them") from e
    return state


def _our_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transformers BERT state dict in our names: a bare BertModel's keys get the `bert.` prefix,
    legacy LayerNorm names are renamed, stored buffers and tied copies dropped (an old checkpoint
    that keeps the MLM bias only as the decoder's gives it to `cls.predictions.bias`)."""
    renamed = {}
    for key, value in state.items():
        for old, new in _LEGACY_NAMES.items():
            key = key.replace(old, new)
        if not key.startswith(("bert.", "cls.")):
            key = f"bert.{key}"
        renamed[key] = value
    if "cls.predictions.bias" not in renamed and "cls.predictions.decoder.bias" in renamed:
        renamed["cls.predictions.bias"] = renamed["cls.predictions.decoder.bias"]
    return {k: v for k, v in renamed.items() if not k.endswith(_BUFFER_SUFFIXES)}


def load_model_folder(folder: Path | str, sequence_classifier: bool = False) -> LoadedModel:
    """Load a BERT checkpoint folder into our BertForPreTraining (eval mode, fp32, CPU); DistilBERT and
    ELECTRA ones are read as BERT (training/bert_family.py).

    `sequence_classifier`: a BertForSequenceClassification's head (a cross-encoder's, a classifier's) is
    read into `LoadedModel.classifier`; otherwise such a checkpoint is refused, as other task heads are.

    In a sentence-transformers folder the transformer may sit in a subfolder (modules.json);
    `LoadedModel.folder` is where it and its tokenizer are. Heads absent from the checkpoint (a bare
    BertModel) are freshly initialised from torch's random state (the MLM decoder tied to the word
    embeddings, as always) and reported through `has_mlm_head` / `has_nsp_head`, so that downstream
    code never serves made-up scores."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFolderError(f"{folder} is not a folder")
    folder = transformer_folder(folder)
    raw_config = _config_json(folder)
    config = _bert_config(folder, raw_config)
    state = _our_names(bert_family.bert_state_dict(raw_config, read_state_dict(folder)))
    decoder = state.pop(_TIED_KEYS[0], None)  # the MLM decoder: our model ties it to the word embeddings
    state.pop(_TIED_KEYS[1], None)
    architectures = raw_config.get("architectures") or []
    classifier = None
    architecture = architectures[0] if architectures else None
    if sequence_classifier and architecture in bert_family.SEQUENCE_CLASSIFIERS:
        classifier = _classifier_head(folder, state, config.hidden_size)
    model = BertForPreTraining(config)
    if (activation := bert_family.pooler_activation(architecture)) is not None:
        model.bert.pooler.activation = activation
    expected = {k for k in model.state_dict() if k not in _TIED_KEYS}
    missing = expected - state.keys()
    encoder_missing = sorted(k for k in missing if k.startswith("bert.") and not k.startswith("bert.pooler."))
    if encoder_missing:
        raise ModelFolderError(f"{folder}: the weights lack {len(encoder_missing)} encoder tensors "
                               f"(e.g. {encoder_missing[0]}); the checkpoint is incomplete or not BERT"
                               f"{_defaults_taken(raw_config)}")
    unexpected = sorted(state.keys() - expected)
    heads = sorted({k.split(".")[1] for k in unexpected if k.removeprefix("bert.").startswith(_TASK_HEADS)})
    if heads:
        kind = architecture or "a fine-tuned model"
        what = ("export serves it (/rerank, /predict), but pretraining would drop that head"
                if kind in bert_family.SEQUENCE_CLASSIFIERS else
                "which this project neither trains nor serves (it serves BERT encoders, cross-encoders and "
                "sequence classifiers)")
        raise ModelFolderError(f"{folder} is {kind}: its weights hold a task head ({', '.join(heads)}); {what}")
    if unexpected:
        raise ModelFolderError(f"{folder}: unexpected tensors (e.g. {unexpected[0]}); not a BERT checkpoint "
                               f"of this configuration")
    try:
        model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shape mismatch: config and weights disagree
        raise ModelFolderError(f"{folder}: weights do not match config.json: {_shape_mismatch(model, state)}"
                               f"{_defaults_taken(raw_config)}") from e
    has_pooler = not any(k.startswith("bert.pooler.") for k in missing)
    has_nsp = has_pooler and not any(k.startswith("cls.seq_relationship.") for k in missing)
    has_mlm = not any(k.startswith("cls.predictions.") for k in missing)
    embeddings = model.bert.embeddings.word_embeddings.weight
    # tie_word_embeddings false: a decoder of its own, which ours cannot hold; its MLM scores are not this model's
    untied = decoder is not None and (decoder.shape != embeddings.shape or not torch.equal(decoder.float(), embeddings))
    # load_state_dict with no decoder key keeps the tie, fresh head or not; be explicit all the same
    model.cls.predictions.decoder.weight = model.bert.embeddings.word_embeddings.weight
    if classifier is not None and not has_pooler:
        raise ModelFolderError(f"{folder}: a sequence classifier without its pooler (bert.pooler.*), which its "
                               f"head reads")
    labels = _labels(folder, raw_config.get("id2label"), classifier.out_features) if classifier is not None else ()
    return LoadedModel(model.eval(), config, has_mlm, has_pooler, has_nsp, folder, classifier, labels, untied,
                       _scoring(raw_config.get("problem_type"), len(labels)))


def _scoring(problem_type: str | None, labels: int) -> str:
    """How transformers' text-classification pipeline scores several labels of `problem_type`: a sigmoid each
    (multi-label: labels do not compete), the logits (regression: values, not probabilities), else a softmax.
    One label stays "auto" (a sigmoid): a cross-encoder's relevance, as TEI and CrossEncoder score it."""
    if labels < 2:
        return "auto"
    return {"multi_label_classification": "sigmoid", "regression": "logits"}.get(problem_type, "auto")


def _classifier_head(folder: Path, state: dict[str, torch.Tensor], hidden_size: int) -> torch.nn.Linear:
    """BertForSequenceClassification's `classifier` (taken out of `state`) as a Linear on the pooler."""
    weight, bias = state.pop("bert.classifier.weight", None), state.pop("bert.classifier.bias", None)
    if weight is None or bias is None or weight.dim() != 2 or weight.shape[1] != hidden_size \
            or tuple(bias.shape) != (weight.shape[0],):
        raise ModelFolderError(f"{folder}: the classifier's weights are not a {hidden_size}-wide Linear "
                               f"(classifier.weight {None if weight is None else tuple(weight.shape)})")
    head = torch.nn.Linear(hidden_size, weight.shape[0])
    with torch.no_grad():
        head.weight.copy_(weight.float())
        head.bias.copy_(bias.float())
    return head.eval()


def _labels(folder: Path, id2label: dict | None, count: int) -> tuple[str, ...]:
    """config.json's id2label in id order (transformers' LABEL_i where it has none)."""
    try:
        named = {int(k): str(v) for k, v in (id2label or {}).items()}
    except (AttributeError, ValueError) as e:
        raise ModelFolderError(f"{folder / CONFIG_FILE}: id2label is not an object of ids to labels") from e
    # transformers takes num_labels from id2label: other ids than the head's outputs are a broken config there
    if named and sorted(named) != list(range(count)):
        raise ModelFolderError(f"{folder / CONFIG_FILE}: id2label names ids {', '.join(map(str, sorted(named)))} but "
                               f"the classifier has {count} outputs (ids 0 to {count - 1}); fix id2label")
    return tuple(named.get(i, f"LABEL_{i}") for i in range(count))
