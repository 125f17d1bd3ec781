"""The mean of each text's real token vectors as a graph output (MEAN_EMBEDDING).

Most sentence-transformers models pool so. Pooled in the graph, a batch hands back one vector a text
instead of every token's: on a GPU the token vectors' copy to the host and the pooling after it cost
mean-pooled requests 2.5x (one text) to 6x (64 texts) their throughput (all-MiniLM-L6-v2,
BENCHMARKS.md), and a host-packed graph, which has no token vectors, can then answer them from a CUDA
graph. Each real token ([CLS] and [SEP] included, as in sentence-transformers' Pooling) weighs 1 / the
text's count, so no sum can outgrow the vectors themselves (fp16 stays in range).
"""
from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from artifact.host_packing import CUMULATIVE_LENGTHS
from artifact.manifest import CLS_EMBEDDING, MEAN_EMBEDDING, TOKEN_EMBEDDINGS
from export import ExportError

_ATTENTION_MASK = "attention_mask"


def add_mean_output(model: onnx.ModelProto) -> None:
    """Add MEAN_EMBEDDING [batch, hidden] to a padded or packed graph, from its token vectors (fp32, as the
    graph answers them) over the real tokens of its attention mask: one batched product of each row's
    weights and its token vectors, which reads them once."""
    graph = model.graph
    if TOKEN_EMBEDDINGS not in {o.name for o in graph.output} or _ATTENTION_MASK not in {i.name for i in graph.input}:
        raise ExportError(f"the graph has no {TOKEN_EMBEDDINGS} output or no {_ATTENTION_MASK} input to pool")
    p = f"{MEAN_EMBEDDING}/"
    graph.initializer.extend([helper.make_tensor(p + "axis1", TensorProto.INT64, [1], [1]),
                              helper.make_tensor(p + "min_count", TensorProto.FLOAT, [], [1e-9])])
    graph.node.extend([
        _node("Cast", [_ATTENTION_MASK], [p + "mask"], to=TensorProto.FLOAT),  # [B, L]
        _node("ReduceSum", [p + "mask", p + "axis1"], [p + "count"], keepdims=1),  # [B, 1]
        _node("Max", [p + "count", p + "min_count"], [p + "divisor"]),  # as sentence-transformers
        _node("Div", [p + "mask", p + "divisor"], [p + "weights"]),
        _node("Unsqueeze", [p + "weights", p + "axis1"], [p + "weights3"]),  # [B, 1, L]
        _node("MatMul", [p + "weights3", TOKEN_EMBEDDINGS], [p + "mean3"]),  # [B, 1, H]
        _node("Squeeze", [p + "mean3", p + "axis1"], [MEAN_EMBEDDING]),
    ])
    graph.output.append(helper.make_tensor_value_info(MEAN_EMBEDDING, TensorProto.FLOAT, ["batch", _hidden(model)]))


def add_host_packed_mean_output(model: onnx.ModelProto, hidden: str) -> None:
    """Add MEAN_EMBEDDING [rows, hidden] to a host-packed graph, from `hidden` ([tokens, hidden], every row's
    tokens one after another) and the rows' cumulative lengths: a [rows, tokens] matrix of 1 / length on
    each row's tokens times the token vectors, in their precision (a row's rounded 1 / length scales its
    vector, never turns it), then fp32. A bucket's empty rows get zeros. Its filler tokens (after every row's)
    are zeroed before the product: the packed attention writes nothing for them, so they hold whatever that
    memory held, and a NaN or inf weighed 0 would still be NaN in every row."""
    graph = model.graph
    p = f"{MEAN_EMBEDDING}/"
    graph.initializer.extend([helper.make_tensor(p + n, TensorProto.INT64, [1], [v])
                              for n, v in (("zero", 0), ("one", 1), ("minus_one", -1), ("last", 2 ** 62))])
    graph.initializer.extend([helper.make_tensor(p + "zero_scalar", TensorProto.INT64, [], [0]),
                              helper.make_tensor(p + "one_scalar", TensorProto.INT64, [], [1]),
                              helper.make_tensor(p + "min_count", TensorProto.FLOAT, [], [1.0]),
                              helper.make_tensor(p + "zero_float", TensorProto.FLOAT, [], [0.0])])
    graph.node.extend([
        _node("Shape", [hidden], [p + "count_1d"], start=0, end=1),
        _node("Squeeze", [p + "count_1d", p + "zero"], [p + "count"]),
        _node("Range", [p + "zero_scalar", p + "count", p + "one_scalar"], [p + "places"]),  # [T]
        _node("Unsqueeze", [p + "places", p + "zero"], [p + "places_row"]),  # [1, T]
        _node("Cast", [CUMULATIVE_LENGTHS], [p + "cumulative"], to=TensorProto.INT64),  # [R + 1]
        _node("Slice", [p + "cumulative", p + "zero", p + "minus_one"], [p + "starts_1d"]),
        _node("Slice", [p + "cumulative", p + "one", p + "last"], [p + "ends_1d"]),
        _node("Unsqueeze", [p + "starts_1d", p + "one"], [p + "starts"]),  # [R, 1]
        _node("Unsqueeze", [p + "ends_1d", p + "one"], [p + "ends"]),
        _node("GreaterOrEqual", [p + "places_row", p + "starts"], [p + "after_start"]),  # [R, T]
        _node("Less", [p + "places_row", p + "ends"], [p + "before_end"]),
        _node("And", [p + "after_start", p + "before_end"], [p + "in_row"]),
        _node("Cast", [p + "in_row"], [p + "in_row_f"], to=TensorProto.FLOAT),
        _node("Sub", [p + "ends", p + "starts"], [p + "lengths"]),
        _node("Cast", [p + "lengths"], [p + "lengths_f"], to=TensorProto.FLOAT),
        _node("Max", [p + "lengths_f", p + "min_count"], [p + "divisor"]),
        _node("Div", [p + "in_row_f", p + "divisor"], [p + "weights"]),  # [R, T]
        _node("Slice", [p + "cumulative", p + "minus_one", p + "last"], [p + "real_count"]),  # [1]
        _node("Less", [p + "places", p + "real_count"], [p + "real_1d"]),  # [T]: not filler
        _node("Unsqueeze", [p + "real_1d", p + "one"], [p + "real"]),  # [T, 1]
        _node("CastLike", [p + "zero_float", hidden], [p + "zero_like"]),
        _node("Where", [p + "real", hidden, p + "zero_like"], [p + "hidden_real"]),  # [T, H]
        _node("CastLike", [p + "weights", hidden], [p + "weights_like"]),
        _node("MatMul", [p + "weights_like", p + "hidden_real"], [p + "mean"]),  # [R, H]
        _node("Cast", [p + "mean"], [MEAN_EMBEDDING], to=TensorProto.FLOAT),
    ])
    graph.output.append(helper.make_tensor_value_info(MEAN_EMBEDDING, TensorProto.FLOAT, ["rows", _hidden(model)]))


def _node(op_type: str, inputs: list[str], outputs: list[str], **attributes) -> onnx.NodeProto:
    """A node named after its output, so that a profile or a quantiser's exclusion list can name it."""
    return helper.make_node(op_type, inputs, outputs, name=outputs[0] if "/" in outputs[0] else f"{outputs[0]}/out",
                            **attributes)


def is_mean_node(node: onnx.NodeProto) -> bool:
    """Whether `node` is one of the nodes these functions add."""
    return any(name == MEAN_EMBEDDING or name.startswith(f"{MEAN_EMBEDDING}/") for name in node.output)


def _hidden(model: onnx.ModelProto) -> int:
    """The hidden size, from the [batch, hidden] [CLS] output (the server sizes its buffers from it)."""
    dims = next((o.type.tensor_type.shape.dim for o in model.graph.output if o.name == CLS_EMBEDDING), ())
    if len(dims) != 2 or not dims[1].dim_value:
        raise ExportError(f"the graph's {CLS_EMBEDDING} output has no fixed width to size {MEAN_EMBEDDING} by")
    return dims[1].dim_value
