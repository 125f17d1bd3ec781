"""ONNX Runtime's transformer optimiser on the traced graph, fp16 conversion, and the fusion check.

The fusions are measured, not hoped for: an fp32/fp16 graph whose attention did not fuse runs several
times slower on GPU, so the export fails instead of shipping it.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx

from export import ExportError
from export.mean_output import add_mean_output
from export.smoothing import smooth_activations
from training.model import BertConfig

# Fused kernels recorded in the manifest (fp32 / fp16 graphs: ORT's statistics; int8: op counts).
ATTENTION_OPS = ("Attention", "MultiHeadAttention")
GELU_OPS = ("BiasGelu", "FastGelu", "Gelu")
# ORT's attention operators on a packed batch: PackedAttention runs the Q, K and V product itself (one
# GEMM, then a bias-and-transpose kernel and, on Hopper, the memory-efficient attention kernel);
# PackedMultiHeadAttention reads Q, K and V from MatMuls before it and can run FlashAttention's
# variable-length kernel on them.
PACKED_ATTENTION_OPS = ("PackedAttention", "PackedMultiHeadAttention")
INT8_OPS = ("QAttention", "Attention", "QEmbedLayerNormalization", "EmbedLayerNormalization",
            "SkipLayerNormalization", "BiasGelu", "FastGelu", "Gelu", "MatMulInteger", "DynamicQuantizeMatMul")


class _SmallVocabularyNotice(logging.Filter):
    """Drops ORT's EmbedLayerNormalization fusion's warning that the word table is no larger than the
    position table: its guess at which table is which, for a TODO; it takes them from the graph's Gathers,
    the parity gate judges the fused graph, and a vocabulary of 512 or fewer is common for models trained
    here on a small corpus."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("word_embedding_table (")


_SMALL_VOCABULARY_NOTICE = _SmallVocabularyNotice()  # one instance: addFilter skips a filter already added


class FusionError(ExportError):
    """ORT's optimiser did not fuse what a BERT graph must fuse."""


def expected_fusions(num_layers: int, head_gelus: int = 0) -> dict[tuple[str, ...], int]:
    """Op-type groups -> the count each group must reach for a fully fused BERT encoder; `head_gelus`:
    GELUs outside the encoder (an ELECTRA classifier's head has one where BERT's pooler has tanh)."""
    return {
        ATTENTION_OPS: num_layers,
        ("EmbedLayerNormalization",): 1,
        ("SkipLayerNormalization",): 2 * num_layers,  # after attention and after the FFN
        GELU_OPS: num_layers + head_gelus,
    }


def check_fusions(counts: dict[str, int], num_layers: int, what: str, head_gelus: int = 0) -> None:
    for group, want in expected_fusions(num_layers, head_gelus).items():
        got = sum(counts.get(op, 0) for op in group)
        if got != want:
            raise FusionError(
                f"{what}: ORT fused {got} {'/'.join(group)} where {want} were expected (fused operators: "
                f"{ {k: v for k, v in counts.items() if v} }); the exported graph no longer matches ORT's "
                f"BERT patterns"
            )


def optimize_graph(raw: Path, dst: Path, config: BertConfig, *, use_gpu: bool, float16: bool,
                   remove_padding: bool = False, packed_attention: str = PACKED_ATTENTION_OPS[0],
                   head_gelus: int = 0) -> dict[str, int]:
    """Fuse `raw` (fp32, as traced) into `dst`, fp16 inside with float32 inputs/outputs if `float16`.

    `remove_padding` (CUDA only: ORT has no CPU kernels for it) packs the real tokens of the batch
    before the first layer and restores the padded shape after the last, so the matmuls skip padding;
    the graph's inputs and outputs stay the same; `packed_attention` (one of PACKED_ATTENTION_OPS) is
    the attention operator it then runs. The graph also answers the mean of the real token vectors
    (export.mean_output). Returns the fused-operator counts, with the packed attention /
    RemovePadding counts when packed; raises FusionError when the encoder did not fully fuse (`head_gelus`:
    see expected_fusions)."""
    from onnxruntime.transformers import optimizer
    from onnxruntime.transformers.fusion_options import FusionOptions

    if packed_attention not in PACKED_ATTENTION_OPS:
        raise ValueError(f"packed attention must be one of {', '.join(PACKED_ATTENTION_OPS)}, not {packed_attention!r}")
    options = FusionOptions("bert")
    # MultiHeadAttention (the Q, K, V MatMuls left outside) is what packing turns into PackedMultiHeadAttention
    options.use_multi_head_attention = remove_padding and packed_attention == "PackedMultiHeadAttention"

    # ORT's transformers package imports its modules by their bare names: so are their loggers named
    logging.getLogger("fusion_embedlayer").addFilter(_SMALL_VOCABULARY_NOTICE)
    opt = optimizer.optimize_model(
        str(raw),
        model_type="bert",
        num_heads=config.num_attention_heads,
        hidden_size=config.hidden_size,
        opt_level=1,  # ORT's default for BERT: basic, provider-independent rewrites, then the Python fusions
        use_gpu=use_gpu,
        optimization_options=options,
    )
    counts = {k: int(v) for k, v in opt.get_fused_operator_statistics().items()}
    check_fusions(counts, config.num_hidden_layers, "fp16 graph" if float16 else "fp32 graph", head_gelus)
    if float16:
        # keep_io_types: the server feeds int64 ids and reads float32 outputs, with no cast of its own
        opt.convert_float_to_float16(keep_io_types=True)
    if remove_padding:
        counts.update(_pack(opt, config.num_hidden_layers, packed_attention))
    add_mean_output(opt.model)
    opt.save_model_to_file(str(dst))
    return counts


def _pack(opt, num_layers: int, attention: str) -> dict[str, int]:
    """ORT's packing mode: RemovePadding after the embeddings (it reads the per-row token counts that
    EmbedLayerNormalization makes from the mask), `attention` per layer, RestorePadding at the end."""
    from onnxruntime.transformers.convert_to_packing_mode import PackingMode

    # ORT's symbolic shape inference knows PackedAttention but not PackedMultiHeadAttention; the session
    # infers shapes when it loads the graph either way
    PackingMode(opt).convert(use_symbolic_shape_infer=attention == "PackedAttention")
    ops = Counter(node.op_type for node in opt.model.graph.node)
    counts = {op: ops.get(op, 0) for op in (attention, "RemovePadding", "RestorePadding")}
    if counts != {attention: num_layers, "RemovePadding": 1, "RestorePadding": 1}:
        raise FusionError(f"packing (padding removal) did not apply to every layer: {counts}")
    return counts


# Sub-layers left fp32, as (layer, part): the first three layers are where MiniLM's outlier activations
# form (its layer-0 FFN output input has a GELU channel at 25 where the median channel reaches 1.4), and
# their int8 error reaches every later layer and every token. This set, picked on calibration and other
# held-out batches rather than on the gate's, brings all-MiniLM-L6-v2's mean-pooled vector to the gate's
# 0.995 for less CPU than keeping every Attention fp32 (BENCHMARKS.md, "int8 recipe").
KEEP_FP32 = ((0, "output"), (1, "output"), (2, "attention"), (2, "intermediate"))


def kept_fp32(model: onnx.ModelProto) -> list[str]:
    """Names of the nodes of a fused BERT graph that KEEP_FP32 names: "output" / "intermediate" are the
    FFN's MatMuls, "attention" the layer's fused Attention node (the k-th in graph order is layer k)."""
    attention = [n.name for n in model.graph.node if n.op_type == "Attention"]
    names = []
    for layer, part in KEEP_FP32:
        if part == "attention":
            names += attention[layer:layer + 1]
        else:
            names += [n.name for n in model.graph.node
                      if n.op_type == "MatMul" and f"/encoder/layer.{layer}/{part}/dense/" in n.name]
    return names


def quantize_int8(fp32_optimized: Path, dst: Path, config: BertConfig,
                  calibration: Sequence[dict[str, np.ndarray]]) -> dict[str, int]:
    """Dynamic int8 quantisation (weights int8 per output channel, activations quantised at run time)
    for the CPU, of the fused graph: Attention becomes QAttention, the dense MatMuls MatMulInteger.
    Before that, export.smoothing moves the activations' outlier channels into the weights, measured
    on the `calibration` feeds. The recipe and what each part buys on all-MiniLM-L6-v2 are in
    BENCHMARKS.md ("int8 recipe")."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    model = onnx.load(str(fp32_optimized))
    keep_fp32 = kept_fp32(model)
    smooth_activations(model, calibration, exclude=keep_fp32)
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # quantize_dynamic logs a pre-processing advice meant for CNNs
    try:
        quantize_dynamic(
            model, str(dst), weight_type=QuantType.QInt8,
            per_channel=True,  # one scale per output channel
            # The embedding tables stay fp32: a lookup gains no speed from int8, only error.
            op_types_to_quantize=["MatMul", "Attention"],
            nodes_to_exclude=keep_fp32,
            # ORT's contrib ops (SkipLayerNormalization, ...) defeat ONNX shape inference; they are float.
            # Only products by a weight (ORT's default, stated): the mean's product of the token vectors
            # (export.mean_output), quantised, would add its own error to the served mean (all-MiniLM-L6-v2:
            # cosine 0.9997 to the unquantised product's).
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT, "MatMulConstBOnly": True},
        )
    finally:
        root.setLevel(level)
    ops = Counter(node.op_type for node in onnx.load(str(dst), load_external_data=False).graph.node)
    counts = {op: ops.get(op, 0) for op in INT8_OPS}
    attention = counts["QAttention"] + counts["Attention"]
    if attention != config.num_hidden_layers:
        raise FusionError(f"int8 graph: {attention} (Q)Attention nodes where {config.num_hidden_layers} were expected")
    return counts
