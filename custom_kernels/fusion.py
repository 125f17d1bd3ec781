"""Graph rewrite: each MatMul -> com.microsoft.BiasGelu pair of an ORT-fused graph becomes one
bertserve.MatMulBiasGelu node (needs onnx; export runs it, the server never does)."""
from __future__ import annotations

from collections import Counter

import onnx
from onnx import helper

from custom_kernels import DOMAIN

MATMUL_BIAS_GELU = "MatMulBiasGelu"


def fuse_matmul_bias_gelu(model: onnx.ModelProto) -> int:
    """Rewrites `model` in place and returns how many pairs it fused. A pair fuses when the MatMul's
    output feeds only that BiasGelu (and is no graph output), its weight is a 2-D initializer and the
    bias has the weight's column count. The fused node keeps the BiasGelu's output name and place, so
    everything downstream is untouched."""
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    nodes = list(graph.node)
    producer = {out: i for i, node in enumerate(nodes) for out in node.output}
    uses = Counter(name for node in nodes for name in node.input)
    graph_outputs = {o.name for o in graph.output}
    fused: dict[int, onnx.NodeProto] = {}  # BiasGelu index -> its replacement
    dropped: set[int] = set()  # MatMul indices
    for i, gelu in enumerate(nodes):
        if gelu.op_type != "BiasGelu" or gelu.domain != "com.microsoft" or len(gelu.input) != 2:
            continue
        j = producer.get(gelu.input[0])
        matmul = nodes[j] if j is not None else None
        if matmul is None or matmul.op_type != "MatMul" or matmul.domain not in ("", "ai.onnx"):
            continue
        if uses[matmul.output[0]] != 1 or matmul.output[0] in graph_outputs:
            continue
        weight, bias = initializers.get(matmul.input[1]), initializers.get(gelu.input[1])
        if weight is None or len(weight.dims) != 2 or bias is None or list(bias.dims) != [weight.dims[1]]:
            continue
        fused[i] = helper.make_node(MATMUL_BIAS_GELU, [matmul.input[0], matmul.input[1], gelu.input[1]],
                                    list(gelu.output), name=f"{gelu.name or matmul.name}_fused", domain=DOMAIN)
        dropped.add(j)
    if not fused:
        return 0
    # Copies: the messages in `nodes` belong to graph.node, which is emptied next.
    kept = [_copy(fused.get(i, node)) for i, node in enumerate(nodes) if i not in dropped]
    gone = {nodes[j].output[0] for j in dropped}
    value_info = [_copy(v) for v in graph.value_info if v.name not in gone]
    del graph.node[:]
    graph.node.extend(kept)
    del graph.value_info[:]
    graph.value_info.extend(value_info)
    if DOMAIN not in {o.domain for o in model.opset_import}:
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return len(fused)


def _copy(message):
    duplicate = type(message)()
    duplicate.CopyFrom(message)
    return duplicate
