"""Graph rewrites onto our operators (needs onnx; export runs them, the server never does):
each MatMul -> com.microsoft.BiasGelu pair of an ORT-fused graph becomes one bertserve.MatMulBiasGelu
node, and the Q, K and V MatMuls of a (Packed)MultiHeadAttention become bertserve.MatMulBias nodes that
add the attention's bias themselves."""
from __future__ import annotations

from collections import Counter

import onnx
from onnx import helper, numpy_helper

from custom_kernels import DOMAIN

MATMUL_BIAS_GELU = "MatMulBiasGelu"
MATMUL_BIAS = "MatMulBias"
# ORT's attention operators that read Q, K and V (inputs 0-2) and add a [3·hidden] bias (input 3)
MULTI_HEAD_ATTENTION_OPS = ("MultiHeadAttention", "PackedMultiHeadAttention")


class _Graph:
    """What the rewrites look up in a graph: its nodes in order, initializers, who produces and who reads
    each value, and its outputs."""

    def __init__(self, graph: onnx.GraphProto):
        self.nodes = list(graph.node)
        self.initializers = {t.name: t for t in graph.initializer}
        self.producer = {out: i for i, node in enumerate(self.nodes) for out in node.output}
        self.uses = Counter(name for node in self.nodes for name in node.input)
        self.outputs = {o.name for o in graph.output}

    def sole_matmul(self, value: str) -> tuple[int, onnx.NodeProto, onnx.TensorProto] | None:
        """(index, node, weight) of the MatMul that makes `value`, when one node alone reads it (it is no
        graph output) and its weight is a 2-D initializer; else None."""
        j = self.producer.get(value)
        matmul = self.nodes[j] if j is not None else None
        if matmul is None or matmul.op_type != "MatMul" or matmul.domain not in ("", "ai.onnx"):
            return None
        if self.uses[value] != 1 or value in self.outputs:
            return None
        weight = self.initializers.get(matmul.input[1])
        return (j, matmul, weight) if weight is not None and len(weight.dims) == 2 else None


def fuse_matmul_bias_gelu(model: onnx.ModelProto) -> int:
    """Rewrites `model` in place and returns how many pairs it fused. A pair fuses when the MatMul's
    output feeds only that BiasGelu (and is no graph output), its weight is a 2-D initializer and the
    bias has the weight's column count. The fused node keeps the BiasGelu's output name and place, so
    everything downstream is untouched."""
    g = _Graph(model.graph)
    fused: dict[int, onnx.NodeProto] = {}  # BiasGelu index -> its replacement
    dropped: set[int] = set()  # MatMul indices
    for i, gelu in enumerate(g.nodes):
        if gelu.op_type != "BiasGelu" or gelu.domain != "com.microsoft" or len(gelu.input) != 2:
            continue
        found = g.sole_matmul(gelu.input[0])
        bias = g.initializers.get(gelu.input[1])
        if found is None or bias is None or list(bias.dims) != [found[2].dims[1]]:
            continue
        j, matmul, _ = found
        fused[i] = helper.make_node(MATMUL_BIAS_GELU, [matmul.input[0], matmul.input[1], gelu.input[1]],
                                    list(gelu.output), name=f"{gelu.name or matmul.name}_fused", domain=DOMAIN)
        dropped.add(j)
    if not fused:
        return 0
    _rewrite(model, fused, dropped)
    gone = {g.nodes[j].output[0] for j in dropped}
    value_info = [_copy(v) for v in model.graph.value_info if v.name not in gone]
    del model.graph.value_info[:]
    model.graph.value_info.extend(value_info)
    return len(fused)


def fuse_attention_bias(model: onnx.ModelProto) -> int:
    """Rewrites `model` in place and returns how many MatMuls it replaced (three per attention). For each
    MultiHeadAttention / PackedMultiHeadAttention whose Q, K and V each come from a MatMul read by that
    node alone (weight a 2-D initializer) and whose bias is a 1-D initializer of their three widths, the
    MatMuls become MatMulBias nodes with their third of the bias, and the attention loses its bias input:
    with none, ORT's attention reads Q, K and V where they are instead of adding the bias into a copy."""
    g = _Graph(model.graph)
    replaced: dict[int, onnx.NodeProto] = {}
    new_initializers: list[onnx.TensorProto] = []
    split_biases: set[str] = set()
    for attention in g.nodes:
        if (attention.op_type not in MULTI_HEAD_ATTENTION_OPS or attention.domain != "com.microsoft"
                or len(attention.input) < 4 or not all(attention.input[:4])):
            continue
        bias = g.initializers.get(attention.input[3])
        found = [g.sole_matmul(name) for name in attention.input[:3]]  # read once each: three distinct MatMuls
        if bias is None or len(bias.dims) != 1 or None in found:
            continue
        if sum(weight.dims[1] for _, _, weight in found) != bias.dims[0]:
            continue
        values, start = numpy_helper.to_array(bias), 0
        for (j, matmul, weight), part in zip(found, "qkv"):
            piece = numpy_helper.from_array(values[start:start + weight.dims[1]], f"{attention.input[3]}_{part}")
            start += weight.dims[1]
            new_initializers.append(piece)
            replaced[j] = helper.make_node(MATMUL_BIAS, [matmul.input[0], matmul.input[1], piece.name],
                                           list(matmul.output), name=f"{matmul.name or matmul.output[0]}_bias",
                                           domain=DOMAIN)
        split_biases.add(attention.input[3])
        attention.input[3] = ""  # the messages in `nodes` are graph.node's own: this edits the graph
    if not replaced:
        return 0
    model.graph.initializer.extend(new_initializers)
    _rewrite(model, replaced, set())
    unread = split_biases - {name for node in model.graph.node for name in node.input} - g.outputs
    kept = [_copy(t) for t in model.graph.initializer if t.name not in unread]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    return len(replaced)


def _rewrite(model: onnx.ModelProto, replaced: dict[int, onnx.NodeProto], dropped: set[int]) -> None:
    """graph.node with node i replaced by replaced[i] and the nodes in `dropped` left out, in the same
    order, and our domain imported."""
    graph = model.graph
    # Copies: the messages in graph.node go when it is emptied.
    kept = [_copy(replaced.get(i, node)) for i, node in enumerate(graph.node) if i not in dropped]
    del graph.node[:]
    graph.node.extend(kept)
    if DOMAIN not in {o.domain for o in model.opset_import}:
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))


def _copy(message):
    duplicate = type(message)()
    duplicate.CopyFrom(message)
    return duplicate
