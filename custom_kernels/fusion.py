"""Graph rewrites onto our operators (needs onnx; export runs them, the server never does):
each MatMul -> com.microsoft.BiasGelu pair of an ORT-fused graph becomes one bertserve.MatMulBiasGelu
node, the Q, K and V MatMuls of a (Packed)MultiHeadAttention become bertserve.MatMulBias nodes that
add the attention's bias themselves, a PackedMultiHeadAttention left without its bias becomes
bertserve.PackedAttention, whose three products then become one (bertserve.PackedQKVAttention reads
its thirds in place), and com.microsoft.RemovePadding becomes bertserve.RemovePadding."""
from __future__ import annotations

import logging
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from custom_kernels import DOMAIN

log = logging.getLogger("custom_kernels.fusion")

MATMUL_BIAS_GELU = "MatMulBiasGelu"
MATMUL_BIAS = "MatMulBias"
PACKED_ATTENTION = "PackedAttention"
PACKED_QKV_ATTENTION = "PackedQKVAttention"
REMOVE_PADDING = "RemovePadding"  # the same name as ORT's operator, in our domain
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
    _drop_value_info(model, {g.nodes[j].output[0] for j in dropped})
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
    _drop_unread_initializers(model, split_biases, g.outputs)
    return len(replaced)


def packed_attention_head_sizes(model: onnx.ModelProto) -> set[int]:
    """The head sizes of the PackedMultiHeadAttention nodes that attention_on_packed_kernel would take."""
    return {size for _, _, size in _packed_attention_nodes(_Graph(model.graph))}


def attention_on_packed_kernel(model: onnx.ModelProto) -> int:
    """Rewrites `model` in place and returns how many PackedMultiHeadAttention nodes became
    bertserve.PackedAttention (src/packed_attention_kernel.cu). A node is taken when it has no bias
    (fuse_attention_bias moved it into the products) and no attention bias, and its query comes from a
    product whose weight gives the width; the new node reads the same query, key, value, token_offset
    and cumulative_sequence_length, so nothing around it changes."""
    g = _Graph(model.graph)
    replaced: dict[int, onnx.NodeProto] = {}
    for i, node, head_size in _packed_attention_nodes(g):
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        inputs = list(node.input) + [""] * (6 - len(node.input))
        replaced[i] = helper.make_node(PACKED_ATTENTION, [*inputs[:3], *inputs[4:6]], list(node.output),
                                       name=f"{node.name or node.output[0]}_packed", domain=DOMAIN,
                                       num_heads=int(attrs["num_heads"]), head_size=head_size,
                                       scale=float(attrs.get("scale", 0.0)) or head_size ** -0.5)
    if replaced:
        _rewrite(model, replaced, set())
    return len(replaced)


def _packed_attention_nodes(g: _Graph) -> list[tuple[int, onnx.NodeProto, int]]:
    """(index, node, head size) of each PackedMultiHeadAttention attention_on_packed_kernel can take."""
    found = []
    for i, node in enumerate(g.nodes):
        if node.op_type != "PackedMultiHeadAttention" or node.domain != "com.microsoft":
            continue
        inputs = list(node.input) + [""] * (7 - len(node.input))
        query, _, _, bias, token_offset, cumulative, attention_bias = inputs[:7]
        producer = g.nodes[g.producer[query]] if query in g.producer else None
        weight = g.initializers.get(producer.input[1]) if producer is not None and len(producer.input) > 1 else None
        heads = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "num_heads"), 0)
        if bias or attention_bias or not (token_offset and cumulative) or weight is None or len(weight.dims) != 2:
            continue
        if heads <= 0 or weight.dims[1] % heads:
            continue
        found.append((i, node, int(weight.dims[1] // heads)))
    return found


def fuse_qkv_products(model: onnx.ModelProto) -> int:
    """Rewrites `model` in place and returns how many bertserve.PackedAttention nodes became
    bertserve.PackedQKVAttention over one product. A node is taken when its query, key and value come from
    three MatMulBias nodes (fuse_attention_bias made them) of one input, each read by it alone, with 2-D
    initializer weights of one shape and 1-D initializer biases: one MatMulBias then makes [T, 3·H·D] from
    the weights and biases side by side (Q | K | V), in the first product's place, and the attention reads
    its thirds where they are. One product instead of three runs faster, and launches two kernels fewer."""
    g = _Graph(model.graph)
    replaced: dict[int, onnx.NodeProto] = {}
    dropped: set[int] = set()
    gone: set[str] = set()  # the three products' outputs
    merged: set[str] = set()  # their weights and biases
    new_initializers: list[onnx.TensorProto] = []
    for i, attention in enumerate(g.nodes):
        if attention.op_type != PACKED_ATTENTION or attention.domain != DOMAIN:
            continue
        products = [g.producer.get(name) for name in attention.input[:3]]
        if None in products or len(set(products)) != 3:
            continue
        nodes = [g.nodes[j] for j in products]
        if any(n.op_type != MATMUL_BIAS or n.domain != DOMAIN or g.uses[n.output[0]] != 1 or n.output[0] in g.outputs
               for n in nodes) or len({n.input[0] for n in nodes}) != 1:
            continue
        weights = [g.initializers.get(n.input[1]) for n in nodes]
        biases = [g.initializers.get(n.input[2]) for n in nodes]
        if None in weights or None in biases or len({tuple(w.dims) for w in weights}) != 1 or len(weights[0].dims) != 2:
            continue
        if any(list(b.dims) != [weights[0].dims[1]] for b in biases):
            continue
        name = attention.output[0]
        weight = numpy_helper.from_array(np.concatenate([numpy_helper.to_array(w) for w in weights], axis=1),
                                         f"{name}_qkv_weight")
        bias = numpy_helper.from_array(np.concatenate([numpy_helper.to_array(b) for b in biases]), f"{name}_qkv_bias")
        new_initializers += [weight, bias]
        first = min(products)
        replaced[first] = helper.make_node(MATMUL_BIAS, [nodes[0].input[0], weight.name, bias.name], [f"{name}_qkv"],
                                           name=f"{attention.name or name}_qkv_product", domain=DOMAIN)
        dropped.update(j for j in products if j != first)
        gone.update(n.output[0] for n in nodes)
        merged.update(name for n in nodes for name in n.input[1:3])
        attrs = {a.name: helper.get_attribute_value(a) for a in attention.attribute}
        replaced[i] = helper.make_node(PACKED_QKV_ATTENTION, [f"{name}_qkv", *attention.input[3:5]], [name],
                                       name=f"{attention.name or name}_qkv", domain=DOMAIN, **attrs)
    if not dropped:
        return 0
    model.graph.initializer.extend(new_initializers)
    _rewrite(model, replaced, dropped)
    _drop_value_info(model, gone)
    _drop_unread_initializers(model, merged, g.outputs)
    return sum(1 for node in replaced.values() if node.op_type == PACKED_QKV_ATTENTION)


def remove_padding_on_our_kernel(model: onnx.ModelProto) -> int:
    """Rewrites `model` in place and returns how many com.microsoft.RemovePadding nodes became
    bertserve.RemovePadding (src/remove_padding.cc): the same inputs and outputs, names and place."""
    replaced = 0
    for node in model.graph.node:
        if node.op_type == REMOVE_PADDING and node.domain == "com.microsoft":
            node.domain = DOMAIN
            replaced += 1
    if replaced:
        _import_domain(model)
    return replaced


def remove_padding_model(elem: int = onnx.TensorProto.FLOAT16) -> onnx.ModelProto:
    """One bertserve.RemovePadding node over input [B, S, H] (`elem`) and sequence_token_count [B] int32, all
    four outputs: the probe's graph, and the tests'."""
    outputs = [("output", elem, ["T", "H"]), ("token_offset", onnx.TensorProto.INT32, ["B", "S"]),
               ("cumulative_sequence_length", onnx.TensorProto.INT32, ["B1"]),
               ("max_token_count", onnx.TensorProto.INT32, [1])]
    graph = helper.make_graph(
        [helper.make_node(REMOVE_PADDING, ["input", "sequence_token_count"], [name for name, _, _ in outputs],
                          domain=DOMAIN)], "remove_padding",
        [helper.make_tensor_value_info("input", elem, ["B", "S", "H"]),
         helper.make_tensor_value_info("sequence_token_count", onnx.TensorProto.INT32, ["B"])],
        [helper.make_tensor_value_info(*output) for output in outputs])
    return helper.make_model(graph, ir_version=8,
                             opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])


def packed_attention_model(heads: int, head_size: int, elem: int = onnx.TensorProto.FLOAT16,
                           width: int | str | None = None) -> onnx.ModelProto:
    """One bertserve.PackedAttention node over inputs q, k, v [T, width] (`elem`), token_offset [B, S] and cu
    [B + 1]: the probe's graph, and the tests'. `width` defaults to heads · head_size; a name leaves it open."""
    width = heads * head_size if width is None else width
    graph = helper.make_graph(
        [helper.make_node(PACKED_ATTENTION, ["q", "k", "v", "token_offset", "cu"], ["out"], domain=DOMAIN,
                          num_heads=heads, head_size=head_size, scale=head_size ** -0.5)], "packed_attention",
        [helper.make_tensor_value_info(n, elem, ["T", width]) for n in "qkv"]
        + [helper.make_tensor_value_info("token_offset", onnx.TensorProto.INT32, ["B", "S"]),
           helper.make_tensor_value_info("cu", onnx.TensorProto.INT32, ["B1"])],
        [helper.make_tensor_value_info("out", elem, ["T", width])])
    # IR version 8 (opset 17's): onnx writes its newest, which an older onnxruntime refuses to load
    return helper.make_model(graph, ir_version=8,
                             opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)])


def offers_packed_attention(library, head_size: int) -> bool:
    """Whether our operator library (a path) runs PackedAttention at `head_size` on this machine's GPU
    (build.sh leaves the operator out without nvcc, and the kernel needs compute capability 8.0)."""
    return _opens_on_cuda(library, packed_attention_model(heads=1, head_size=head_size),
                          f"PackedAttention at head size {head_size}")


def offers_remove_padding(library) -> bool:
    """Whether our operator library (a path) runs RemovePadding on this machine's GPU (build.sh leaves it
    out without nvcc)."""
    return _opens_on_cuda(library, remove_padding_model(), REMOVE_PADDING)


def _opens_on_cuda(library, model: onnx.ModelProto, what: str) -> bool:
    """Whether a one-node graph of our operator opens on the CUDA provider with `library`."""
    from artifact.session import SessionError, open_session

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "probe.onnx"
        onnx.save(model, str(path))
        try:
            open_session(path, "cuda", library=library)
        except SessionError as e:
            log.info("no %s in %s: %s", what, library, e)
            return False
    return True


def _rewrite(model: onnx.ModelProto, replaced: dict[int, onnx.NodeProto], dropped: set[int]) -> None:
    """graph.node with node i replaced by replaced[i] and the nodes in `dropped` left out, in the same
    order, and our domain imported."""
    graph = model.graph
    # Copies: the messages in graph.node go when it is emptied.
    kept = [_copy(replaced.get(i, node)) for i, node in enumerate(graph.node) if i not in dropped]
    del graph.node[:]
    graph.node.extend(kept)
    _import_domain(model)


def _import_domain(model: onnx.ModelProto) -> None:
    """Our operators' domain among the model's opset imports."""
    if DOMAIN not in {o.domain for o in model.opset_import}:
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))


def _drop_unread_initializers(model: onnx.ModelProto, names: set[str], graph_outputs: set[str]) -> None:
    """Leaves out the initializers among `names` that no node reads any more and no graph output is."""
    unread = names - {name for node in model.graph.node for name in node.input} - graph_outputs
    kept = [_copy(t) for t in model.graph.initializer if t.name not in unread]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)


def _drop_value_info(model: onnx.ModelProto, names: set[str]) -> None:
    """Leaves out the value_info of values no node makes any more."""
    kept = [_copy(v) for v in model.graph.value_info if v.name not in names]
    del model.graph.value_info[:]
    model.graph.value_info.extend(kept)


def _copy(message):
    duplicate = type(message)()
    duplicate.CopyFrom(message)
    return duplicate
