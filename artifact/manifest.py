"""The artifact folder contract between `export` (writer) and `app` (reader).

An artifact folder holds `manifest.json`, `tokenizer.json`, one ONNX graph per precision and, for a
sentence-transformers checkpoint with Dense modules, `sentence_dense.npz`. This
module is dependency-free (no torch, no onnx) so both sides import it; bump FORMAT_VERSION on any
incompatible change and make the reader refuse versions it does not know.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

FORMAT_VERSION = 2  # 2: the trained max_length, max_position_embeddings, default pooling, typed graph variants
MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"

# Graph inputs, all int64 [batch, sequence], padded on the right only: the fused attention reads each
# row's mask as a length (ORT's mask index).
INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
# Graph outputs, all float32 (fp16 graphs keep float32 at their boundary).
TOKEN_EMBEDDINGS = "token_embeddings"  # [batch, sequence, hidden]: last hidden state
CLS_EMBEDDING = "cls_embedding"  # [batch, hidden]: raw [CLS] vector
MEAN_EMBEDDING = "mean_embedding"  # [batch, hidden]: the mean of the real tokens' vectors (export/mean_output.py)
POOLED_EMBEDDING = "pooled_embedding"  # [batch, hidden]: tanh(dense([CLS])), BERT's pooler
NSP_LOGITS = "nsp_logits"  # [batch, 2]: index 0 = IsNext, index 1 = NotNext
# [batch, labels]: a fine-tuned sequence classifier's head on the pooler (a cross-encoder has one label)
CLASSIFIER_LOGITS = "classifier_logits"
# How a text's vector is made (app/pooling.py): "pooled" is BERT's pooler (POOLED_EMBEDDING); the others
# are sentence-transformers' Pooling modes, computed as it does ("cls" = the first token, [CLS]).
POOLINGS = ("cls", "pooled", "mean", "max", "mean_sqrt_len", "weightedmean", "lasttoken")
# Which end of an over-long input truncation cuts: "right" keeps its start (the default), "left" its end.
TRUNCATION_DIRECTIONS = ("right", "left")
# How a classifier's logits become the scores /predict answers, as transformers' text-classification pipeline
# scores its config's problem_type: "auto" a sigmoid for one label (a cross-encoder's relevance) and a softmax
# over several (single-label classification, TEI's scoring); "sigmoid" a sigmoid per label (multi-label
# classification); "logits" the logits themselves (regression).
CLASSIFIER_SCORINGS = ("auto", "sigmoid", "logits")
# Graph file per precision: fp32 for CPU (always there), fp16 for CUDA, int8 (dynamic) for CPU.
GRAPH_FILES = {"fp32": "model.onnx", "fp16": "model_fp16.onnx", "int8": "model_int8.onnx"}
# The fp16 graph again with our own CUDA operators (custom_kernels), when export had their library.
KERNELS_GRAPH_FILE = "model_fp16_kernels.onnx"
# A packed fp16 graph's shapes follow its data, so CUDA cannot replay it; its host-packed variant
# (artifact/host_packing.py) can, per (rows, tokens) bucket (app/cuda_graphs.py). With our operators too:
HOST_PACKED_GRAPH_FILE = "model_fp16_host_packed.onnx"
HOST_PACKED_KERNELS_GRAPH_FILE = "model_fp16_host_packed_kernels.onnx"
# A CPU graph again with its last layer for the [CLS] position only (export/last_layer_rows.py), per precision.
CLS_ROWS_GRAPH_FILES = {"fp32": "model_cls_rows.onnx", "int8": "model_int8_cls_rows.onnx"}
# A sentence-transformers checkpoint's Dense modules, applied after its own pooling (numpy .npz: arrays
# "<i>.weight" [out, in] and "<i>.bias" [out], float32), each followed by its activation.
DENSE_FILE = "sentence_dense.npz"
DENSE_ACTIVATIONS = ("tanh", "identity", "relu", "sigmoid", "gelu")


class ManifestError(ValueError):
    """The artifact folder is missing, incomplete or from an unknown format version."""


@dataclass
class CustomKernelsGraph:
    """A graph again, with custom_kernels' operators in place of ONNX Runtime's (custom_kernels/fusion.py),
    gated on parity like every graph. It runs only with their library registered (artifact/session.py)."""
    file: str
    operators: dict[str, int]  # our operator -> how many of the graph's nodes it replaced
    parity: dict[str, float]


@dataclass
class PaddedGraph:
    """A graph with its padding kept, whose shapes are fixed, so that small batches can replay it as CUDA
    graphs per (rows, length) bucket (app/cuda_graphs.py): a padded graph's own file, or the padded twin
    that export gave a packed graph before host-packed variants."""
    file: str
    fused_operators: dict[str, int]
    parity: dict[str, float]
    custom_kernels: CustomKernelsGraph | None = None


@dataclass
class HostPackedGraph:
    """A packed graph's host-packed variant: the same model fed tokens packed by the server, so that CUDA
    can replay it per (rows, tokens) bucket (artifact/host_packing.py). Per-sequence outputs only."""
    file: str
    outputs: list[str]
    parity: dict[str, float]
    custom_kernels: CustomKernelsGraph | None = None


@dataclass
class ClsRowsGraph:
    """A padded graph's variant whose last layer runs at the [CLS] position only: it answers the per-sequence
    outputs ([CLS], pooled, NSP, a classifier), not the token vectors or their mean. Gated on parity."""
    file: str
    outputs: list[str]
    parity: dict[str, float]


@dataclass
class GraphInfo:
    """A precision's graph as export built and checked it, and its variants: packed (ORT drops the padding
    itself) or padded, each with or without our custom kernels."""
    file: str  # relative to the artifact folder
    device: str  # what it was built and checked for: "cpu" | "cuda"
    outputs: list[str]
    fused_operators: dict[str, int] = field(default_factory=dict)
    parity: dict[str, float] = field(default_factory=dict)  # measured against PyTorch fp32 at export
    custom_kernels: CustomKernelsGraph | None = None  # a server without their library runs `file`
    padded: PaddedGraph | None = None  # for CUDA graphs of a padded graph (see PaddedGraph)
    host_packed: HostPackedGraph | None = None  # a packed graph's variant for CUDA graphs
    # A padded CPU graph's variant for the batches that need no token vectors. Written only when there is
    # one, so that a manifest without it reads as before.
    cls_rows: ClsRowsGraph | None = None

    @property
    def packed(self) -> bool:
        """ORT's packing mode: the graph drops the padding itself, so padded tokens cost nothing."""
        return self.fused_operators.get("RemovePadding", 0) > 0

    def files(self) -> list[str]:
        """Every graph file this entry names."""
        variants = [self, self.custom_kernels, self.padded, self.padded and self.padded.custom_kernels,
                    self.host_packed, self.host_packed and self.host_packed.custom_kernels, self.cls_rows]
        return [v.file for v in variants if v]

    @classmethod
    def from_dict(cls, d: dict) -> "GraphInfo":
        def kernels(k: dict | None) -> CustomKernelsGraph | None:
            return CustomKernelsGraph(**k) if k else None

        def variant(kind: type, v: dict | None):
            return kind(**{**v, "custom_kernels": kernels(v.get("custom_kernels"))}) if v else None

        rows = d.get("cls_rows")
        return cls(**{**d, "custom_kernels": kernels(d.get("custom_kernels")),
                      "padded": variant(PaddedGraph, d.get("padded")),
                      "host_packed": variant(HostPackedGraph, d.get("host_packed")),
                      "cls_rows": _typed(ClsRowsGraph(**rows)) if rows else None})


# The Manifest fields written only when they differ from their default (each added after format 2 was set).
_WRITTEN_WHEN_SET = ("sentence_dense", "prompts", "default_prompt_name", "classifier_labels", "classifier_scoring",
                     "truncation_direction")


@dataclass
class Manifest:
    model_name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    max_length: int  # the longest sequence served: the length the model was trained at (or export's --max-length)
    max_position_embeddings: int  # the longest sequence the weights accept at all
    has_pooler: bool
    has_nsp_head: bool
    lowercase: bool
    special_tokens: dict[str, int]  # "[CLS]", "[SEP]", "[PAD]", "[MASK]", "[UNK]" -> id
    # What /embed and /v1/embeddings do unless a request (or setting) says otherwise: a sentence-transformers
    # checkpoint's own Pooling / Normalize modules; "cls", not normalised, for other checkpoints.
    default_pooling: str  # one of POOLINGS
    default_normalize: bool
    graphs: dict[str, GraphInfo]  # precision -> graph
    weights_sha256: str  # of the model folder's weights the export read (provenance; the server never opens them)
    # sha256 of every file the server opens (tokenizer.json and each graph file), checked before it opens one.
    files_sha256: dict[str, str]
    versions: dict[str, str]
    created_at: str
    # The checkpoint's Dense modules in order (DENSE_FILE): {"in_features", "out_features", "bias", "activation"}.
    # Written only when there are some, so that a model without them reads as before.
    sentence_dense: list[dict] = field(default_factory=list)
    # A sentence-transformers checkpoint's prompts (name -> text put before a text) and the one put before
    # every text unasked. Written only when there are some, as sentence_dense.
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    # A sequence classifier's labels, in the order of CLASSIFIER_LOGITS (one for a cross-encoder's score);
    # written only for such a model.
    classifier_labels: list[str] = field(default_factory=list)
    # How its logits are scored (CLASSIFIER_SCORINGS); written only when not "auto".
    classifier_scoring: str = "auto"
    # Which end truncation cuts when a request does not say: the checkpoint's tokenizer_config.json
    # truncation_side, as transformers' tokenizer and sentence-transformers cut; written only when "left".
    truncation_direction: str = "right"
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        record = asdict(self)
        for f in fields(self):  # the optional ones at their default are left out: an older manifest reads the same
            if f.name in _WRITTEN_WHEN_SET and record[f.name] == (
                    f.default if f.default_factory is MISSING else f.default_factory()):
                del record[f.name]
        for graph in record["graphs"].values():
            if graph["cls_rows"] is None:
                del graph["cls_rows"]
        return json.dumps(record, indent=2, sort_keys=True) + "\n"

    @property
    def sentence_width(self) -> int:
        """The width of the model's own sentence vectors: the last Dense module's, else the hidden size."""
        return self.sentence_dense[-1]["out_features"] if self.sentence_dense else self.hidden_size

    @classmethod
    def from_dict(cls, d: dict) -> "Manifest":
        if not isinstance(d, dict):
            raise ManifestError(f"manifest is a JSON {type(d).__name__}, not an object: re-export the model")
        version = d.get("format_version")
        if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
            raise ManifestError(f"manifest format_version {version} is newer than this server reads "
                                f"({FORMAT_VERSION}): serve it with the version that exported it, or re-export the "
                                f"model with this one")
        if version != FORMAT_VERSION:
            raise ManifestError(f"manifest format_version {version!r} is not {FORMAT_VERSION}: re-export the "
                                f"model with this version of `python -m export`")
        try:
            graphs = {k: _typed(GraphInfo.from_dict(g)) for k, g in d["graphs"].items()}
            manifest = _typed(cls(**{**d, "graphs": graphs}))
        except (KeyError, TypeError, AttributeError) as e:
            raise ManifestError(f"manifest is incomplete or malformed ({e}): re-export the model with this "
                                f"version of `python -m export`") from e
        if not manifest.graphs:
            raise ManifestError("manifest names no graph: re-export the model")
        for name in ("hidden_size", "num_layers", "num_heads", "vocab_size", "max_position_embeddings"):
            if getattr(manifest, name) <= 0:
                raise ManifestError(f"manifest {name} {getattr(manifest, name)} is not a positive number: re-export "
                                    f"the model")
        if manifest.default_pooling not in POOLINGS:
            raise ManifestError(f"manifest default_pooling {manifest.default_pooling!r} is not one of {', '.join(POOLINGS)}")
        if manifest.default_pooling == "pooled" and not manifest.has_pooler:  # else every default request fails
            raise ManifestError("manifest default_pooling 'pooled' names BERT's pooler, but the model has none: "
                                "re-export the model")
        width = manifest.hidden_size
        for layer in manifest.sentence_dense:
            if not (isinstance(layer, dict) and layer.get("in_features") == width
                    and layer.get("activation") in DENSE_ACTIVATIONS and isinstance(layer.get("out_features"), int)):
                raise ManifestError(f"manifest sentence_dense {layer!r} is not a Dense layer taking {width}-wide "
                                    f"vectors: re-export the model")
            width = layer["out_features"]
        if manifest.classifier_scoring not in CLASSIFIER_SCORINGS or (
                manifest.classifier_scoring != "auto" and len(manifest.classifier_labels) < 2):
            raise ManifestError(f"manifest classifier_scoring {manifest.classifier_scoring!r} is not one of "
                                f"{', '.join(CLASSIFIER_SCORINGS)}, or not auto without several classifier labels: "
                                f"re-export the model")
        if manifest.truncation_direction not in TRUNCATION_DIRECTIONS:
            raise ManifestError(f"manifest truncation_direction {manifest.truncation_direction!r} is not right or "
                                f"left: re-export the model")
        if manifest.default_prompt_name is not None and manifest.default_prompt_name not in manifest.prompts:
            raise ManifestError(f"manifest default_prompt_name {manifest.default_prompt_name!r} is not one of its "
                                f"prompts: re-export the model")
        lacking = [p for p, g in manifest.graphs.items() if manifest.classifier_labels and CLASSIFIER_LOGITS not in g.outputs]
        if lacking:
            raise ManifestError(f"manifest names classifier labels but its {lacking[0]} graph has no {CLASSIFIER_LOGITS} "
                                f"output: re-export the model")
        if not 0 < manifest.max_length <= manifest.max_position_embeddings:
            raise ManifestError(f"manifest max_length {manifest.max_length} is not within the model's "
                                f"{manifest.max_position_embeddings} positions")
        return manifest

    def verify(self, folder: Path | str, names: Iterable[str]) -> dict[str, str]:
        """Check `names` (files of the artifact at `folder`) against their recorded sha256; the verified
        digests by name. A file changed or damaged since export is a ManifestError naming it."""
        folder, names = Path(folder), list(names)

        def check(name: str) -> str:
            expected = self.files_sha256.get(name)
            if expected is None:
                raise ManifestError(f"{folder / name} has no sha256 in the manifest: re-export the model")
            try:
                actual = sha256_file(folder / name)
            except OSError as e:
                raise ManifestError(f"{folder / name} cannot be read ({e.strerror}): re-export the model") from e
            if actual != expected:
                raise ManifestError(f"{folder / name} is not the file export wrote (sha256 {actual[:16]}..., "
                                    f"the manifest says {expected[:16]}...): it was changed or damaged; re-export")
            return actual

        # hashlib lets go of the GIL while it hashes, so the graph files of several variants take one
        # core each; a failure is raised for the first file in `names` order that has one.
        with ThreadPoolExecutor(max(1, min(len(names), os.cpu_count() or 1))) as pool:
            return dict(zip(names, pool.map(check, names)))

    def graph(self, precision: str) -> GraphInfo:
        if precision not in self.graphs:
            how = {"fp16": "on a GPU with `python -m export --device cuda`",
                   "int8": "with `python -m export --int8`"}.get(precision, "with `python -m export`")
            raise ManifestError(f"this artifact has no {precision} graph (it has {', '.join(self.graphs)}); "
                                f"export one {how}")
        return self.graphs[precision]


_KINDS = {"int": int, "str": str, "bool": bool, "dict": dict, "list": list}


def _typed(record):
    """`record` (a dataclass just built from JSON) if each field holds its annotated kind (int, str, bool,
    dict, list, and the keys and values of dict[str, str] / dict[str, int]); else a TypeError naming it."""
    for f in fields(record):
        kind, value = f.type.split("[")[0].split(" |")[0], getattr(record, f.name)
        wanted = _KINDS.get(kind)
        if wanted is None or (value is None and "None" in f.type):
            continue
        if not isinstance(value, wanted) or (wanted is int and isinstance(value, bool)):
            raise TypeError(f"{f.name} is {value!r}, not {kind}")
        inner = {"dict[str, str]": str, "dict[str, int]": int}.get(f.type)
        if inner and not all(isinstance(k, str) and isinstance(v, inner) for k, v in value.items()):
            raise TypeError(f"{f.name} is not {f.type}")
    return record


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(folder: Path | str, graphs: bool = True) -> Manifest:
    """The manifest of the artifact at `folder`, after checking that every file it names is there and has a
    sha256. graphs=False: a folder holding only the files the HTTP side reads (tokenizer, Dense layers)."""
    folder = Path(folder)
    path = folder / MANIFEST_FILE
    if not path.is_file():
        raise ManifestError(f"{folder} has no {MANIFEST_FILE}: it is not an artifact folder made by "
                            f"`python -m export` (or the export did not finish)")
    try:
        manifest = Manifest.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path} is not valid JSON: {e}") from e
    except ManifestError as e:
        raise ManifestError(f"{path}: {e}") from e
    files = [f for g in manifest.graphs.values() for f in g.files()] if graphs else []
    files += [DENSE_FILE] if manifest.sentence_dense else []
    for needed in [TOKENIZER_FILE, *files]:
        if not (folder / needed).is_file():
            raise ManifestError(f"{folder} lacks {needed}, which its manifest names; re-export it")
        if needed not in manifest.files_sha256:  # else verify() would pass over it
            raise ManifestError(f"{path} has no sha256 of {needed}; re-export the model")
    return manifest
