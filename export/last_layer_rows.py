"""The last layer of a graph computed for the [CLS] rows only: a host-packed CUDA graph's, in place, and a
padded CPU graph's, as a variant beside it.

A host-packed graph without the mean (export/host_packing.py) answers per-sequence outputs only: the
[CLS] vector and what is made from it (pooled, NSP, a classifier). Everything after the last attention
works token by token (products, residual sums, LayerNorm, GELU), so the rows that no output reads can be
dropped right after that attention instead of at the end: the attention's output and the residual it is
added to are gathered at the [CLS] positions, and the last layer's output product and feed-forward block
run on one row per sequence. For BERT-base that is 3/4 of one layer's products out of twelve layers'.
The attention itself still runs for every token, since the [CLS] row attends to all of them.

A padded graph ([batch, length, hidden], the CPU's) also answers the token vectors and their mean, which
need every row, so its [CLS]-rows graph is a second file without those outputs (padded_for_cls_rows): the
server runs the batches that want neither on it.
"""
from __future__ import annotations

from collections import defaultdict

import onnx
import numpy as np
from onnx import helper, numpy_helper

from artifact.host_packing import CLS_POSITIONS
from artifact.manifest import MEAN_EMBEDDING, TOKEN_EMBEDDINGS

# Nodes that act on each token's row by itself (any other input is a weight, a bias or a constant)
ROW_WISE = frozenset({"MatMul", "MatMulBias", "MatMulBiasGelu", "SkipLayerNormalization",
                      "SkipSimplifiedLayerNormalization", "LayerNormalization", "SimplifiedLayerNormalization",
                      "Add", "Mul", "Gelu", "FastGelu", "BiasGelu", "QuickGelu", "Relu", "Tanh", "Erf", "Div",
                      "Cast", "Identity"})
ATTENTION = frozenset({"PackedAttention", "PackedQKVAttention", "PackedMultiHeadAttention", "MultiHeadAttention",
                       "Attention", "QAttention"})
EVERY_TOKEN = (TOKEN_EMBEDDINGS, MEAN_EMBEDDING)  # the outputs a [CLS]-rows graph cannot answer
FIRST_POSITION = "cls_rows_first_position"  # the [0] that a padded graph's inserted Gathers read


def last_layer_for_cls_rows(model: onnx.ModelProto) -> bool:
    """Rewrites `model` in place when it has that shape: every Gather(axis 0) of the [CLS] positions reads one
    tensor, made from the last attention's output by row-wise nodes that nothing else reads. Returns whether
    it did; a graph of any other shape is left as it is."""
    graph = model.graph
    nodes = list(graph.node)
    gathers = [n for n in nodes if n.op_type == "Gather" and n.input[1] == CLS_POSITIONS and _axis(n) == 0]
    hidden = {n.input[0] for n in gathers}
    attentions = [n for n in nodes if n.op_type in ATTENTION]
    if len(hidden) != 1 or not attentions:
        return False
    (hidden,) = hidden
    attended = attentions[-1].output[0]
    made_by = {out: n for n in nodes for out in n.output}
    readers = defaultdict(list)
    for n in nodes:
        for name in n.input:
            readers[name].append(n)

    region = nodes_between(attended, hidden, made_by)
    # an empty region (the [CLS] rows read straight off the attention) has nothing to run on fewer rows, and
    # its Gathers must stay: the rewrite would hand their readers every token's row
    if not region or any(n.op_type not in ROW_WISE for n in region):
        return False
    inside = {id(n) for n in region} | {id(n) for n in gathers}
    outputs = {o.name for o in graph.output}
    for n in region:  # nothing outside reads a row the rewrite drops
        for out in n.output:  # "" is an optional output left out (SkipLayerNormalization's mean, ...), no tensor
            if out and (out in outputs or any(id(r) not in inside for r in readers[out])):
                return False

    gathered = gather_entering(graph, region, made_by, CLS_POSITIONS, axis=0)
    # the Gathers at the end become the tensor itself, which now has a row per sequence
    renamed = {n.output[0]: hidden for n in gathers if n.output[0] not in outputs}
    ends = {id(n) for n in gathers}
    kept = []
    for n in nodes:
        if id(n) in ends:
            if n.output[0] in outputs:
                kept.append(helper.make_node("Identity", [hidden], [n.output[0]], name=n.name))
            continue
        for i, name in enumerate(n.input):
            n.input[i] = renamed.get(name, name)
        kept.append(n)
        if n is attentions[-1]:
            kept += gathered
    # the residual may come from before the attention: each Gather goes right after what it reads
    ordered = in_order(kept, {i.name for i in graph.input} | {t.name for t in graph.initializer})
    del graph.node[:]
    graph.node.extend(ordered)
    return True


def padded_for_cls_rows(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """A copy of the padded graph `model` whose last layer runs at the [CLS] position (0) only, without the
    outputs that need every token; None when `model` has another shape. The [CLS] vector is read by
    Gather(axis 1, index 0) of one tensor made from the last attention's output; what enters that region from
    before (the attention's output, the residual) is gathered at [0] along axis 1, so it stays
    [batch, 1, hidden] and the Gather at the end still reads position 0. The region may hold any node (an
    int8 graph's per-tensor DynamicQuantizeLinear included: its scale then comes from the [CLS] rows alone,
    which export's parity gate judges like the rest)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    nodes = list(graph.node)
    zero = _scalar_zeros(graph)
    cls_gathers = [n for n in nodes if n.op_type == "Gather" and _axis(n) == 1 and n.input[1] in zero]
    hidden = {n.input[0] for n in cls_gathers}
    attentions = [n for n in nodes if n.op_type in ATTENTION]
    if len(hidden) != 1 or not attentions:
        return None
    (hidden,) = hidden
    made_by = {out: n for n in nodes for out in n.output}
    region = nodes_between(attentions[-1].output[0], hidden, made_by)
    if not region:
        return None
    made_inside = {out for n in region for out in n.output}
    graph.initializer.append(numpy_helper.from_array(np.array([0], dtype=np.int64), FIRST_POSITION))
    gathered = gather_entering(graph, region, made_by, FIRST_POSITION, axis=1)

    kept_outputs = [o for o in graph.output if o.name not in EVERY_TOKEN]
    del graph.output[:]
    graph.output.extend(kept_outputs)
    every = nodes + gathered
    made_by = {out: n for n in every for out in n.output}
    live, stack, seen = {}, [o.name for o in kept_outputs], set()
    while stack:  # the nodes the kept outputs need
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if (node := made_by.get(name)) is not None:
            live[id(node)] = node
            stack.extend(i for i in node.input if i)
    inside = {id(n) for n in region} | {id(n) for n in cls_gathers}
    if any(id(n) not in inside and any(i in made_inside for i in n.input) for n in live.values()):
        return None  # something outside the region reads a row the variant drops
    ordered = in_order([n for n in every if id(n) in live],
                       {i.name for i in graph.input} | {t.name for t in graph.initializer})
    del graph.node[:]
    graph.node.extend(ordered)
    del graph.value_info[:]  # the region's shapes changed: ORT infers them again
    used = {i for n in ordered for i in n.input}
    initializers = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    onnx.checker.check_model(model)
    return model


def _scalar_zeros(graph: onnx.GraphProto) -> set[str]:
    """Names of the graph's int64 scalar zeros: initializers and Constant nodes."""
    values = [(t.name, t) for t in graph.initializer]
    values += [(n.output[0], n.attribute[0].t) for n in graph.node
               if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"]
    zeros = set()
    for name, tensor in values:
        value = numpy_helper.to_array(tensor)
        if value.ndim == 0 and value.dtype.kind in "iu" and int(value) == 0:
            zeros.add(name)
    return zeros


def gather_entering(graph: onnx.GraphProto, region: list[onnx.NodeProto], made_by: dict[str, onnx.NodeProto],
                    indices: str, axis: int) -> list[onnx.NodeProto]:
    """The region's nodes made to read, in place of each activation that enters it from before (the
    attention's output, the residual), that activation's rows at `indices` along `axis`; the Gather nodes
    that make them, one per such activation, in the order the region first reads them."""
    constant = constant_names(graph, made_by)
    made_inside = {out for n in region for out in n.output}
    entering = []
    for n in region:
        for name in n.input:
            if name and name not in made_inside and name not in constant and name not in entering:
                entering.append(name)
    rows = {name: f"{name}_cls_rows" for name in entering}
    for n in region:
        for i, name in enumerate(n.input):
            n.input[i] = rows.get(name, name)
    return [helper.make_node("Gather", [name, indices], [rows[name]], name=f"{rows[name]}_gather", axis=axis)
            for name in entering]


def _axis(node: onnx.NodeProto) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 0)


def nodes_between(start: str, end: str, made_by: dict[str, onnx.NodeProto]) -> list[onnx.NodeProto] | None:
    """The nodes on some path from tensor `start` to tensor `end` (those `end` depends on that depend on
    `start`), in graph order; None when `end` does not depend on `start`."""
    depends: dict[str, bool] = {}

    def reaches(name: str) -> bool:  # iterative: a deep graph must not hit the recursion limit
        stack = [name]
        while stack:
            top = stack[-1]
            if top in depends:
                stack.pop()
                continue
            node = made_by.get(top)
            if top == start or node is None:
                depends[top] = top == start
                stack.pop()
                continue
            pending = [i for i in node.input if i and i not in depends]
            if pending:
                stack.extend(pending)
            else:
                depends[top] = any(depends[i] for i in node.input if i)
                stack.pop()
        return depends[name]

    if not reaches(end):
        return None
    region = {id(made_by[name]): made_by[name] for name, yes in depends.items() if yes and name != start}
    order = {id(n): i for i, n in enumerate(made_by.values())}
    return sorted(region.values(), key=lambda n: order[id(n)])


def constant_names(graph: onnx.GraphProto, made_by: dict[str, onnx.NodeProto]) -> set[str]:
    """Tensors that depend on no graph input: initializers, Constants and what is made from them only."""
    constant = {t.name for t in graph.initializer}
    for n in graph.node:
        if all(not name or name in constant for name in n.input):
            constant.update(n.output)
    return constant


def in_order(nodes: list[onnx.NodeProto], available: set[str]) -> list[onnx.NodeProto]:
    """`nodes` in an order where each comes after what it reads (the given order where it already is)."""
    made, ordered, waiting = set(available), [], list(nodes)
    while waiting:
        progressed, still = False, []
        for n in waiting:
            if all(not name or name in made for name in n.input):
                ordered.append(n)
                made.update(n.output)
                progressed = True
            else:
                still.append(n)
        if not progressed:
            raise ValueError(f"the graph has nodes whose inputs nothing makes: {[n.name for n in still][:5]}")
        waiting = still
    return ordered
