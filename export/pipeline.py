"""export_artifact: model folder -> artifact folder (graphs, tokenizer.json, manifest.json).

Order of work: load and check the inputs, trace, fuse, gate every graph on parity, and only then move
the finished folder into place (built in a temporary sibling, `os.replace`d), so a failed export
leaves nothing behind and a reader never sees a half-written artifact.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import shutil
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from artifact.manifest import (CLS_ROWS_GRAPH_FILES, DENSE_FILE, GRAPH_FILES, HOST_PACKED_GRAPH_FILE,
                               HOST_PACKED_KERNELS_GRAPH_FILE, KERNELS_GRAPH_FILE, MANIFEST_FILE, POOLED_EMBEDDING,
                               TOKENIZER_FILE, ClsRowsGraph, CustomKernelsGraph, GraphInfo, HostPackedGraph, Manifest,
                               PaddedGraph, sha256_file)
from artifact.session import SessionError, kernels_library, open_session, require_cuda
from artifact.source_folder import ModelFolderError, trained_max_length, truncation_side
from export import ExportError
from export.checkpoint_layout import CheckpointLayout, read_layout
from export.onnx_graph import EmbeddingGraph, served_outputs, trace_to_onnx
from export.optimize import PACKED_ATTENTION_OPS, optimize_graph, quantize_int8
from export.parity import (DEFAULT_SHAPES, ParityError, check_parity, compare, random_batches, reference_outputs,
                           text_batches)
from export.sentences import CALIBRATION_SENTENCES, SENTENCES
from training.model_folder import LoadedModel, load_model_folder, weights_files
from training.wordpiece import (CLS, MASK, PAD, SEP, TRANSFORMERS_NORMALIZER_KEYS, UNK, load_tokenizer_from_folder,
                                transformers_normalizer)
from training.writes import (WriteError, check_writable, first_few, remove_stale_siblings, remove_unfinished,
                             temporary_sibling)

log = logging.getLogger("export")

DEVICES = ("cpu", "cuda")
REQUIRED_SPECIAL_TOKENS = (CLS, SEP, PAD)
MIN_MAX_LENGTH = 8  # room for [CLS] A [SEP] B [SEP] with a few tokens of each text
# The deepest model that gets CPU [CLS]-rows graphs by default: the variant saves about 3/4 of one layer of a
# [CLS] batch (2 layers: 34-39%; 6: 8-12%; 12: 4-7%, bench/cpu_cls_rows.py) for its size again on disk and,
# served, in memory.
CLS_ROWS_MAX_LAYERS = 6


def default_model_name(model_dir: Path) -> str:
    """The name the server answers as `model` unless told another: the repository id of a Hugging Face
    cache snapshot (.../models--ORG--NAME/snapshots/HASH -> ORG/NAME), else the folder's name."""
    folder = model_dir.resolve()
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent.name.removeprefix("models--").replace("--", "/")
    return folder.name


def default_packed_attention(library: Path | None) -> str:
    """The packed graph's attention operator when none is asked for: measured on an H100 (BENCHMARKS.md,
    "GPU engine"), with our MatMulBias taking the Q, K and V bias PackedMultiHeadAttention's graph is 6-10%
    faster than PackedAttention's; without our operators (`library` None) it is 3% slower."""
    return PACKED_ATTENTION_OPS[1] if library is not None else PACKED_ATTENTION_OPS[0]


def export_artifact(
    model_dir: Path | str, out_dir: Path | str, device: str = "cpu", int8: bool = False,
    remove_padding: bool = True, parity_shapes=DEFAULT_SHAPES, seed: int = 0, kernels: str = "auto",
    cuda_graphs: bool | None = None, max_length: int | None = None, packed_attention: str | None = None,
    attention_kernel: bool = True, cls_rows: str = "auto",
) -> Manifest:
    """Export `model_dir` (ours, or a local Hugging Face BERT checkpoint) to the artifact at `out_dir`.

    Always an fp32 graph for the CPU; with device="cuda" also an fp16 graph, built and checked on the
    GPU (by default in ORT's packing mode, which skips the padding: `remove_padding`, with
    `packed_attention` as its attention operator, one of export.optimize.PACKED_ATTENTION_OPS; by default
    PackedMultiHeadAttention with custom_kernels' library, PackedAttention without); with int8 also
    a dynamically quantised CPU graph. With device="cuda", `kernels` "auto" also writes the fp16 graph
    with custom_kernels' operators when their library is found ("on": it must be; "off": never), gated
    on parity like the others; with `attention_kernel` its packed attention runs on ours
    (bertserve.PackedAttention) where the library runs it at the model's head size on this GPU, and on
    ORT's PackedMultiHeadAttention otherwise or when it is False. `cuda_graphs` (default: with device="cuda"): the server may replay the
    fp16 graph as CUDA graphs; a packed graph gets a host-packed variant (and its kernels variant) for
    that (export.host_packing), a padded graph is replayed as it is. `cls_rows` "auto" also writes each CPU
    graph with its last layer at the [CLS] position only (export.last_layer_rows.padded_for_cls_rows, gated
    on parity) for a model of at most CLS_ROWS_MAX_LAYERS layers, where that saves the most ("on": at any
    depth; "off": never).
    The artifact serves texts of up to `max_length` tokens, by default the length the model was trained
    at (artifact.source_folder.trained_max_length), and pools them as a sentence-transformers folder
    says (export.checkpoint_layout; else the raw [CLS] vector).
    Raises ExportError / ModelFolderError (one line) when an input is bad, a fusion is missing or a
    graph fails parity; nothing is written then."""
    if device not in DEVICES:
        raise ExportError(f"device must be one of {', '.join(DEVICES)}, not {device!r}")
    if cuda_graphs is None:
        cuda_graphs = device == "cuda"
    if cls_rows not in ("auto", "on", "off"):
        raise ExportError(f"cls_rows must be auto, on or off, not {cls_rows!r}")
    if cuda_graphs and device != "cuda":
        raise ExportError("CUDA graphs replay the fp16 graph: --cuda-graphs needs --device cuda")
    try:
        library = kernels_library(kernels, device)  # None on the CPU
        if device == "cuda":
            require_cuda()
    except SessionError as e:
        raise ExportError(str(e)) from e
    if packed_attention is None:
        packed_attention = default_packed_attention(library)
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    _check_out_dir(out_dir, model_dir)
    layout = read_layout(model_dir)
    loaded = load_model_folder(layout.encoder_dir, sequence_classifier=True)
    tokenizer = _load_tokenizer(layout.encoder_dir, loaded.config.vocab_size)
    specials = special_token_ids(tokenizer)
    if layout.lowercase and not is_lowercase(tokenizer):
        raise ExportError(f"{layout.encoder_dir}: sentence-transformers lower-cases texts (do_lower_case) but "
                          f"this tokenizer does not; the server would tokenise them differently")
    _check_transformers_reading(layout.encoder_dir, tokenizer)
    served_length = _served_length(layout, loaded.config.max_position_embeddings, max_length)
    try:
        direction = truncation_side(layout.encoder_dir)
    except ModelFolderError as e:
        raise ExportError(str(e)) from e

    graph = EmbeddingGraph(loaded.model, loaded.has_pooler, loaded.has_nsp_head, loaded.classifier).eval()
    # Judged up to the served length: the server never feeds longer inputs, and positions past the trained
    # length would skew int8's calibration.
    batches, calibration = parity_feeds(tokenizer, specials, loaded.config.vocab_size, served_length,
                                        parity_shapes, seed)
    references = [reference_outputs(graph, feed) for feed in batches]  # shared by every precision

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_siblings(out_dir)  # what a killed export left
    tmp = None
    try:
        tmp = temporary_sibling(out_dir, ".partial")
        tmp.chmod(0o755)  # mkdtemp makes it private; the artifact is meant to be read by a server user
        traced = tmp / "traced.onnx"
        trace_to_onnx(graph, traced)
        precisions = ["fp32"] + (["fp16"] if device == "cuda" else []) + (["int8"] if int8 else [])
        graphs = {}
        for precision in precisions:
            graphs[precision] = _build_graph(precision, traced, tmp, loaded, graph, batches, references,
                                             remove_padding, calibration=calibration,
                                             packed_attention=packed_attention)
        if cls_rows == "on" or (cls_rows == "auto" and loaded.config.num_hidden_layers <= CLS_ROWS_MAX_LAYERS):
            for precision in CLS_ROWS_GRAPH_FILES.keys() & graphs.keys():
                graphs[precision].cls_rows = _build_cls_rows(tmp, precision, graphs[precision], graph, batches,
                                                             references)
        if library is not None:
            graphs["fp16"].custom_kernels = _build_kernels_graph(tmp, library, graph, batches, references,
                                                                 attention_kernel=attention_kernel)
        if cuda_graphs:
            if remove_padding:
                graphs["fp16"].host_packed = _build_host_packed(tmp, library, graph, batches, references,
                                                                graphs["fp16"], specials[PAD],
                                                                mean=layout.pooling == "mean")
            else:  # a padded graph is replayed as it is
                fp16 = graphs["fp16"]
                fp16.padded = PaddedGraph(fp16.file, fp16.fused_operators, fp16.parity, fp16.custom_kernels)
        traced.unlink()
        tokenizer.save(str(tmp / TOKENIZER_FILE))
        dense_files = _write_dense(layout, tmp)
        manifest = Manifest(
            model_name=default_model_name(model_dir),
            hidden_size=loaded.config.hidden_size,
            num_layers=loaded.config.num_hidden_layers,
            num_heads=loaded.config.num_attention_heads,
            vocab_size=loaded.config.vocab_size,
            max_length=served_length,
            max_position_embeddings=loaded.config.max_position_embeddings,
            has_pooler=loaded.has_pooler,
            has_nsp_head=loaded.has_nsp_head,
            lowercase=is_lowercase(tokenizer),
            special_tokens=specials,
            default_pooling=layout.pooling,
            default_normalize=layout.normalize,
            sentence_dense=[{"in_features": d.weight.shape[1], "out_features": d.weight.shape[0],
                             "bias": d.bias is not None, "activation": d.activation} for d in layout.dense],
            prompts=dict(layout.prompts),
            default_prompt_name=layout.default_prompt_name,
            classifier_labels=list(loaded.classifier_labels),
            classifier_scoring=loaded.scoring,
            truncation_direction=direction,
            graphs=graphs,
            weights_sha256=_weights_sha256(layout.encoder_dir),
            files_sha256={name: sha256_file(tmp / name)
                          for name in [TOKENIZER_FILE, *dense_files, *(f for g in graphs.values() for f in g.files())]},
            versions=versions(),
            created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        )
        (tmp / MANIFEST_FILE).write_text(manifest.to_json())
        _move_into_place(tmp, out_dir)
    except BaseException:
        remove_unfinished(out_dir, tmp, ".partial")
        raise
    return manifest


def _write_dense(layout: CheckpointLayout, folder: Path) -> list[str]:
    """The checkpoint's Dense modules as DENSE_FILE (the server reads numpy, never torch); its name, if written."""
    if not layout.dense:
        return []
    arrays = {}
    for i, layer in enumerate(layout.dense):
        arrays[f"{i}.weight"] = np.ascontiguousarray(layer.weight, dtype=np.float32)
        if layer.bias is not None:
            arrays[f"{i}.bias"] = np.ascontiguousarray(layer.bias, dtype=np.float32)
    np.savez(folder / DENSE_FILE, **arrays)
    return [DENSE_FILE]


def _served_length(layout: CheckpointLayout, positions: int, requested: int | None) -> int:
    """`requested` (export's --max-length), else the length the model was trained at."""
    if requested is not None:
        if requested > positions:
            raise ExportError(f"--max-length {requested} is more than the model's {positions} position embeddings")
        length = requested
    else:
        try:
            length = trained_max_length(layout.encoder_dir)
        except ModelFolderError as e:
            raise ExportError(str(e)) from e
    if length < MIN_MAX_LENGTH:
        raise ExportError(f"a max length of {length} tokens leaves no room for text; it must be at least "
                          f"{MIN_MAX_LENGTH}")
    return length


def parity_feeds(tokenizer: Tokenizer, specials: dict[str, int], vocab_size: int, max_length: int,
                 shapes=DEFAULT_SHAPES, seed: int = 0) -> tuple[list[dict[str, np.ndarray]], list[dict[str, np.ndarray]]]:
    """The gate's feeds (seeded random ids, then export.sentences.SENTENCES) and int8's calibration feeds
    (CALIBRATION_SENTENCES, other sentences than the gate's, then random ids for the tails real text
    misses); the same in every process."""
    special_ids = set(specials.values())
    # Sorted: get_vocab() is a Rust HashMap whose order changes from process to process, and with it
    # which ids the seeded draws picked (the int8 verdict once changed from run to run).
    words = sorted(i for i in tokenizer.get_vocab().values() if i not in special_ids and i < vocab_size)
    if not words:
        raise ExportError(f"the tokenizer has no token besides its special ones (below the config's vocab_size "
                          f"{vocab_size}): nothing to check parity or serve text with")
    cls_id, sep_id, pad_id = specials[CLS], specials[SEP], specials[PAD]
    gate = (random_batches(words, cls_id, sep_id, pad_id, max_length, shapes, seed)
            + text_batches(tokenizer, SENTENCES, max_length, pad_id))
    calibration = (text_batches(tokenizer, CALIBRATION_SENTENCES, max_length, pad_id)
                   + random_batches(words, cls_id, sep_id, pad_id, max_length, shapes, seed + 1))
    return gate, calibration


def _build_graph(precision: str, traced: Path, tmp: Path, loaded: LoadedModel, graph: EmbeddingGraph,
                 batches: list[dict[str, np.ndarray]], references: list[dict[str, np.ndarray]],
                 remove_padding: bool, file: str | None = None,
                 calibration: list[dict[str, np.ndarray]] | None = None,
                 packed_attention: str = PACKED_ATTENTION_OPS[0]) -> GraphInfo:
    path = tmp / (file or GRAPH_FILES[precision])
    # an ELECTRA classifier's head: a GELU where BERT's pooler has tanh, which ORT fuses as the encoder's
    head_gelus = int(POOLED_EMBEDDING in graph.outputs
                     and isinstance(loaded.model.bert.pooler.activation, torch.nn.GELU))
    if precision == "fp32":
        counts = optimize_graph(traced, path, loaded.config, use_gpu=False, float16=False, head_gelus=head_gelus)
    elif precision == "fp16":
        counts = optimize_graph(traced, path, loaded.config, use_gpu=True, float16=True, head_gelus=head_gelus,
                                remove_padding=remove_padding, packed_attention=packed_attention)
    else:
        counts = quantize_int8(tmp / GRAPH_FILES["fp32"], path, loaded.config, calibration)
    device = "cuda" if precision == "fp16" else "cpu"
    figures = compare(_session(path, device), graph, batches, references)
    check_parity(precision, figures)
    return GraphInfo(file=path.name, device=device, outputs=served_outputs(graph), fused_operators=counts,
                     parity=figures)


def _build_kernels_graph(tmp: Path, library: Path, graph: EmbeddingGraph, batches: list[dict[str, np.ndarray]],
                         references: list[dict[str, np.ndarray]], source: str = GRAPH_FILES["fp16"],
                         file: str = KERNELS_GRAPH_FILE, attention_kernel: bool = True) -> CustomKernelsGraph:
    """The fp16 graph `source` with its MatMul + BiasGelu pairs, and the Q, K, V MatMuls of its
    multi-head attention where it has that, on our fused operators, its RemovePadding on ours where the
    library runs that here, and with `attention_kernel` its packed attention on ours where the library runs
    it here (each layer's Q, K and V then one product); checked like the graph itself."""
    import onnx

    from custom_kernels.fusion import (MATMUL_BIAS, MATMUL_BIAS_GELU, PACKED_ATTENTION, PACKED_QKV_ATTENTION,
                                       REMOVE_PADDING, attention_on_packed_kernel, fuse_attention_bias,
                                       fuse_matmul_bias_gelu, fuse_qkv_products, offers_packed_attention,
                                       offers_remove_padding, packed_attention_head_sizes,
                                       remove_padding_on_our_kernel)

    model = onnx.load(str(tmp / source))
    fused = fuse_matmul_bias_gelu(model)
    operators = {MATMUL_BIAS_GELU: fused, MATMUL_BIAS: fuse_attention_bias(model)}
    if any(node.op_type == REMOVE_PADDING for node in model.graph.node) and offers_remove_padding(library):
        operators[REMOVE_PADDING] = remove_padding_on_our_kernel(model)
    head_sizes = packed_attention_head_sizes(model)
    if attention_kernel and len(head_sizes) == 1 and offers_packed_attention(library, head_sizes.pop()):
        operators[PACKED_ATTENTION] = attention_on_packed_kernel(model)
        # then each layer's three products as one, which the attention reads in place
        operators[PACKED_QKV_ATTENTION] = merged = fuse_qkv_products(model)
        operators[PACKED_ATTENTION] -= merged
        operators[MATMUL_BIAS] -= 2 * merged
    if not fused:
        raise ExportError("the fp16 graph has no MatMul + BiasGelu pair for custom_kernels to fuse; export "
                          "with --custom-kernels off")
    path = tmp / file
    onnx.save(model, str(path))
    try:
        session = open_session(path, "cuda", library=library)
    except SessionError as e:
        raise ExportError(f"{e}; rebuild the library (custom_kernels/build.sh) or export with --custom-kernels "
                          f"off") from e
    figures = compare(session, graph, batches, references)
    check_parity("fp16", figures)
    return CustomKernelsGraph(file=path.name, operators={op: n for op, n in operators.items() if n}, parity=figures)


def _build_host_packed(tmp: Path, library: Path | None, graph: EmbeddingGraph, batches: list[dict[str, np.ndarray]],
                       references: list[dict[str, np.ndarray]], packed: GraphInfo, pad_id: int,
                       mean: bool) -> HostPackedGraph:
    """The packed fp16 graph `packed` and its kernels variant as host-packed graphs (export.host_packing),
    each gated on parity like the graph it comes from, on the outputs it has; with the mean (`mean`: the
    model pools so by default) or without, and then with its last layer for the [CLS] rows only."""
    import onnx

    from export.host_packing import HostPackedRunner, host_packed
    from export.last_layer_rows import last_layer_for_cls_rows

    def build(source: str, file: str, session_library: Path | None) -> tuple[list[str], dict[str, float]]:
        model = host_packed(onnx.load(str(tmp / source)), mean)
        if not mean:
            last_layer_for_cls_rows(model)
        outputs = [o.name for o in model.graph.output]  # what host_packed kept
        onnx.save(model, str(tmp / file))
        try:
            session = open_session(tmp / file, "cuda", library=session_library)
        except SessionError as e:
            raise ExportError(str(e)) from e
        figures = compare(HostPackedRunner(session, pad_id), graph, batches, references, outputs)
        check_parity("fp16", figures)
        return outputs, figures

    outputs, figures = build(packed.file, HOST_PACKED_GRAPH_FILE, None)
    kernels = None
    if packed.custom_kernels is not None:
        _, kernel_figures = build(packed.custom_kernels.file, HOST_PACKED_KERNELS_GRAPH_FILE, library)
        kernels = CustomKernelsGraph(HOST_PACKED_KERNELS_GRAPH_FILE, packed.custom_kernels.operators, kernel_figures)
    return HostPackedGraph(HOST_PACKED_GRAPH_FILE, outputs, figures, kernels)


def _build_cls_rows(tmp: Path, precision: str, source: GraphInfo, graph: EmbeddingGraph,
                    batches: list[dict[str, np.ndarray]], references: list[dict[str, np.ndarray]]) -> ClsRowsGraph | None:
    """The CPU graph `source` with its last layer at the [CLS] position only, gated on parity like it on the
    outputs it keeps; None when the graph has another shape or the variant fails the gate (a warning says
    so): the server then runs every batch on `source`, which passed, so the export goes on without it."""
    import onnx

    from export.last_layer_rows import padded_for_cls_rows

    model = padded_for_cls_rows(onnx.load(str(tmp / source.file)))
    if model is None:
        return None
    path = tmp / CLS_ROWS_GRAPH_FILES[precision]
    onnx.save(model, str(path))
    outputs = [o.name for o in model.graph.output]
    figures = compare(_session(path, "cpu"), graph, batches, references, outputs)
    try:
        check_parity(precision, figures)
    except ParityError as e:
        path.unlink()
        log.warning("%s: its variant with the last layer at [CLS] only is not written (%s)", source.file, e)
        return None
    return ClsRowsGraph(path.name, outputs, figures)


def _session(path: Path, device: str):
    """artifact.session's session, its errors as ExportError."""
    try:
        return open_session(path, device)
    except SessionError as e:
        raise ExportError(str(e)) from e


def _check_out_dir(out_dir: Path, model_dir: Path) -> None:
    if out_dir.resolve() == model_dir.resolve():
        raise ExportError(f"--out {out_dir} is the model folder itself; pick another folder")
    try:  # the artifact is written next to --out, then renamed: its parent must take files
        check_writable(out_dir, "--out", replaced_whole=True)
    except WriteError as e:
        raise ExportError(str(e)) from e
    if not out_dir.exists() or (out_dir.is_dir() and not any(out_dir.iterdir())):
        return  # nothing to replace
    named = _artifact_entries(out_dir) if out_dir.is_dir() else None
    if named is None:
        raise ExportError(f"{out_dir} exists and is not an artifact folder (no {MANIFEST_FILE} that `python -m "
                          f"export` wrote); refusing to replace it")
    # An earlier artifact is replaced whole: refuse what export did not put there, which would go with it.
    foreign = sorted(p.name + ("/" if p.is_dir() else "") for p in out_dir.iterdir()
                     if p.is_dir() or not (p.name in named or p.suffix == ".onnx"))
    if foreign:
        raise ExportError(f"--out {out_dir} holds what an artifact does not ({first_few(foreign)}); export replaces "
                          f"--out whole, so it refuses: choose another folder, or move those out")


def _artifact_entries(folder: Path) -> set[str] | None:
    """The names an artifact folder of any format version holds, by its manifest; None when `folder` has
    no manifest that export wrote (another tool's manifest.json among them)."""
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("format_version"), int) \
            or "model_name" not in manifest:
        return None
    named = manifest.get("files_sha256")
    return {MANIFEST_FILE, TOKENIZER_FILE, DENSE_FILE, *(named if isinstance(named, dict) else {})}


def _move_into_place(src: Path, dst: Path) -> None:
    """Replace `dst` (absent, empty, or an earlier artifact) with `src` by renames only."""
    if not dst.exists():
        os.replace(src, dst)
        return
    old = temporary_sibling(dst, ".old")
    os.replace(dst, old / dst.name)
    try:
        os.replace(src, dst)
    except BaseException:
        os.replace(old / dst.name, dst)  # the earlier artifact back in place, not hidden in .old
        raise
    shutil.rmtree(old, ignore_errors=True)


def _load_tokenizer(model_dir: Path, vocab_size: int) -> Tokenizer:
    try:
        tokenizer = load_tokenizer_from_folder(model_dir)
    except ValueError as e:
        raise ExportError(f"no usable tokenizer: {e}") from e
    except Exception as e:  # tokenizers raises its own Exception type on a corrupt tokenizer.json
        raise ExportError(f"{model_dir}: tokenizer could not be read ({e})") from e
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise ExportError(f"{model_dir}: the tokenizer has {size} tokens but the model only {vocab_size} "
                          f"embeddings; tokenizer and weights do not belong together")
    # The server decides padding and truncation from the manifest; a tokenizer.json that pads or
    # truncates on its own would second-guess it.
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


# transformers' BERT tokenizers (AutoTokenizer's choice for BERT, DistilBERT and ELECTRA folders), which build
# their normaliser from tokenizer_config.json (training.wordpiece.transformers_normalizer)
_BERT_TOKENIZER_CLASSES = {f"{family}Tokenizer{fast}" for family in ("Bert", "DistilBert", "Electra")
                           for fast in ("", "Fast")}
# what each BertNormalizer setting does, for the refusal's line
_DOES = {"lowercase": "lower-case", "strip_accents": "strip accents",
         "handle_chinese_chars": "split CJK characters off"}


def _check_transformers_reading(model_dir: Path, tokenizer: Tokenizer) -> None:
    """ExportError (one line) where transformers would tokenise the folder otherwise than its tokenizer.json,
    the server's way, does: a BertNormalizer whose lower-casing, accent stripping or CJK splitting is not
    what tokenizer_config.json (or its absence) makes transformers' BertTokenizer do. The model was most
    likely trained on transformers' ids and sentence-transformers computes with them, but which of the two
    the checkpoint means only its maker can say."""
    normalizer = json.loads(tokenizer.to_str()).get("normalizer") or {}
    if normalizer.get("type") != "BertNormalizer" or not (model_dir / "tokenizer.json").is_file():
        return
    config_file = model_dir / "tokenizer_config.json"
    try:
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    except (OSError, ValueError) as e:
        raise ExportError(f"{config_file} cannot be read ({e})") from e
    if config.get("tokenizer_class", "BertTokenizer") not in _BERT_TOKENIZER_CLASSES:
        return  # transformers reads tokenizer.json as it is

    def behaviour(s: dict) -> dict[str, bool]:  # strip_accents None follows lower-casing
        return {"lowercase": bool(s["lowercase"]), "handle_chinese_chars": bool(s["handle_chinese_chars"]),
                "strip_accents": bool(s["lowercase"] if s["strip_accents"] is None else s["strip_accents"])}

    # tokenizer.json's BertNormalizer, where silent, has transformers' defaults
    file = behaviour({name: normalizer.get(name, default) for _, name, default in TRANSFORMERS_NORMALIZER_KEYS})
    theirs = behaviour(transformers_normalizer(config))
    for key, name, _ in TRANSFORMERS_NORMALIZER_KEYS:
        a, b, does = file[name], theirs[name], _DOES[name]
        if a != b:
            source = f"tokenizer_config.json's {key}" if key in config else f"no {key} in tokenizer_config.json"
            raise ExportError(f"{model_dir}: tokenizer.json does{'' if a else ' not'} {does} but transformers' "
                              f"BertTokenizer would{'' if b else ' not'} ({source}); set {key} in "
                              f"tokenizer_config.json to the tokenisation the model was trained with")


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    ids = {t: tokenizer.token_to_id(t) for t in (CLS, SEP, PAD, MASK, UNK)}
    missing = [t for t in REQUIRED_SPECIAL_TOKENS if ids[t] is None]
    if missing:
        raise ExportError(f"the tokenizer lacks the special tokens {', '.join(missing)}; not a BERT vocabulary")
    return {t: i for t, i in ids.items() if i is not None}


def is_lowercase(tokenizer: Tokenizer) -> bool:
    """Whether the normaliser lower-cases (BertNormalizer(lowercase=True) or a Lowercase step)."""
    def lowers(node) -> bool:
        if not node:
            return False
        if node.get("type") == "Sequence":
            return any(lowers(n) for n in node.get("normalizers", []))
        return node.get("type") == "Lowercase" or bool(node.get("lowercase", False))

    return lowers(json.loads(tokenizer.to_str()).get("normalizer"))


def _weights_sha256(model_dir: Path) -> str:
    """The sha256 of the weights file load_model_folder read; of a sharded model's, the sha256 of the
    shards' own, in their order."""
    files = weights_files(model_dir)
    if len(files) == 1:
        return sha256_file(files[0])
    return hashlib.sha256("".join(sha256_file(f) for f in files).encode()).hexdigest()


def versions() -> dict[str, str]:
    import onnx
    import onnxruntime

    found = {"python": platform.python_version(), "torch": torch.__version__, "onnx": onnx.__version__,
             "onnxruntime": onnxruntime.__version__}
    try:  # recorded when present, never imported (it is not needed to export)
        found["transformers"] = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        pass
    return found
