"""A packed graph whose packing is done by the caller, so that CUDA can replay it.

ORT's packing mode (export/optimize.py) drops the padding inside the graph: RemovePadding counts the real
tokens on the GPU and copies that count to the host to size its output, so every batch's shapes follow
its data and nothing can be captured as a CUDA graph. The host-packed graph takes instead what
RemovePadding made, packed by the server (artifact/host_packing.py): its shapes then follow only the
(rows, tokens) buckets the server picks. It answers the per-sequence outputs ([CLS], pooled, heads);
token vectors stay with the packed graph, which gives them in the padded shape the API returns.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from artifact.host_packing import (CLS_POSITIONS, CUMULATIVE_LENGTHS, HOST_PACKED_INPUTS, TOKEN_OFFSET, TOKENS,
                                   pack_on_host)
from artifact.manifest import MEAN_EMBEDDING, TOKEN_EMBEDDINGS
from custom_kernels import DOMAIN
from export import ExportError
from export.mean_output import add_host_packed_mean_output, is_mean_node

_MS = "com.microsoft"


def host_packed(model: onnx.ModelProto, mean: bool = False) -> onnx.ModelProto:
    """A copy of ORT's packed graph `model` (one EmbedLayerNormalization, RemovePadding and RestorePadding,
    the [CLS] vector taken as Gather(axis 1, index 0) of the restored output) with the host-packed inputs
    (artifact/host_packing.py) and without the token vectors. Raises ExportError when the graph is not of
    that shape. With `mean`, its mean output (export.mean_output) is pooled from the packed tokens; without,
    it is left out: a replay runs every node whatever it is asked for, and the pooling's dozen small kernels
    are worth their time only where the mean is what most requests ask for."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    pools_mean = mean and any(o.name == MEAN_EMBEDDING for o in graph.output)
    nodes = [n for n in graph.node if not is_mean_node(n)]  # pooled again below, from the packed tokens
    embed, remove, restore = (_only(nodes, op) for op in ("EmbedLayerNormalization", "RemovePadding", "RestorePadding"))
    uses = Counter(name for node in nodes for name in node.input)
    if uses[remove.output[3]]:
        raise ExportError("the packed graph reads RemovePadding's longest length; it cannot be packed on the host")

    split = [f"{TOKENS}_{part}" for part in ("ids", "types", "positions")]  # each [1, tokens]
    split_node = helper.make_node("Split", [TOKENS], split, name="split_tokens", axis=0)
    embed_inputs = list(embed.input) + [""] * (9 - len(embed.input))
    embed_inputs[0], embed_inputs[1], embed_inputs[7], embed_inputs[8] = split[0], split[1], "", split[2]
    # [1, tokens, hidden] -> [tokens, hidden], the name RemovePadding gave its output
    axis0 = helper.make_tensor("squeeze_axis0", TensorProto.INT64, [1], [0])
    graph.initializer.append(axis0)
    embedded = f"{embed.output[0]}_tokens"
    squeeze = helper.make_node("Squeeze", [embedded, axis0.name], [remove.output[0]], name="squeeze_tokens")
    renamed = {remove.output[1]: TOKEN_OFFSET, remove.output[2]: CUMULATIVE_LENGTHS}
    restored, hidden = restore.output[0], restore.input[0]
    dropped_outputs = {o.name for o in graph.output if o.name in (TOKEN_EMBEDDINGS, MEAN_EMBEDDING)}

    kept: list[onnx.NodeProto] = [split_node]
    for node in nodes:
        if node is remove or node is restore:
            continue
        node = _copy(node)
        if node.op_type == "EmbedLayerNormalization" and node.domain == _MS:
            del node.input[:]
            node.input.extend(embed_inputs)
            node.output[0] = embedded
            kept += [node, squeeze]
            continue
        for i, name in enumerate(node.input):
            node.input[i] = renamed.get(name, name)
        if restored in node.input:
            if node.op_type == "Gather" and _gathers_first_position(node, graph):
                node.input[0], node.input[1] = hidden, CLS_POSITIONS
                del node.attribute[:]
                node.attribute.append(helper.make_attribute("axis", 0))
            elif not (node.op_type in ("Cast", "Identity") and set(node.output) <= dropped_outputs):
                raise ExportError(f"the packed graph reads its padded output in {node.op_type} node {node.name!r}; "
                                  f"only the [CLS] position can be taken from a host-packed graph")
        kept.append(node)

    del graph.output[:]
    graph.output.extend(_copy(o) for o in model.graph.output if o.name not in dropped_outputs)
    del graph.input[:]
    graph.input.extend([
        helper.make_tensor_value_info(TOKENS, TensorProto.INT32, [3, "tokens"]),
        helper.make_tensor_value_info(TOKEN_OFFSET, TensorProto.INT32, ["rows", "length"]),
        helper.make_tensor_value_info(CUMULATIVE_LENGTHS, TensorProto.INT32, ["rows_plus_1"]),
        helper.make_tensor_value_info(CLS_POSITIONS, TensorProto.INT32, ["rows"]),
    ])
    for output in graph.output:  # [batch, ...] outputs now have a row per bucket row
        dims = output.type.tensor_type.shape.dim
        if dims and dims[0].dim_param:
            dims[0].dim_param = "rows"
    del graph.value_info[:]  # shapes of the renamed and dropped values; ORT infers them at load
    del graph.node[:]
    graph.node.extend(_live(kept, {o.name for o in graph.output}))
    used = {name for node in graph.node for name in node.input}
    initializers = [_copy(t) for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(initializers)
    if pools_mean:
        add_host_packed_mean_output(out, hidden)
    return out


class HostPackedRunner:
    """A host-packed graph's session behind the padded graphs' `run(names, feeds)` (export's parity gate
    feeds every graph the same padded batches): each batch packed on the host, in a bucket of its own size."""

    def __init__(self, session, pad_id: int):
        self.session, self.pad_id = session, pad_id

    def run(self, names: list[str], feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        real = feed["attention_mask"].astype(bool)
        lengths = real.sum(1)
        rows, width = real.shape
        inputs = pack_on_host(lengths, feed["input_ids"][real], feed["token_type_ids"][real], rows,
                              int(lengths.sum()), width, self.pad_id)
        return self.session.run(names, dict(zip(HOST_PACKED_INPUTS, inputs)))


def _only(nodes: list[onnx.NodeProto], op_type: str) -> onnx.NodeProto:
    # RemovePadding may be ORT's or ours (custom_kernels.fusion.remove_padding_on_our_kernel): the same node
    found = [n for n in nodes if n.op_type == op_type and n.domain in (_MS, DOMAIN)]
    if len(found) != 1:
        raise ExportError(f"a packed graph has one {op_type} node, this one {len(found)}")
    return found[0]


def _gathers_first_position(node: onnx.NodeProto, graph: onnx.GraphProto) -> bool:
    """Gather(axis 1) of the scalar 0 from a Constant node or an initializer: the [CLS] token."""
    axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
    index = node.input[1]
    value = next((numpy_helper.to_array(t) for t in graph.initializer if t.name == index), None)
    for const in graph.node:
        if const.op_type == "Constant" and const.output[0] == index:
            value = numpy_helper.to_array(next(a.t for a in const.attribute if a.name == "value"))
    return axis == 1 and value is not None and value.ndim == 0 and int(value) == 0


def _live(nodes: list[onnx.NodeProto], outputs: set[str]) -> list[onnx.NodeProto]:
    """`nodes` (in order) that some graph output depends on."""
    needed, keep = set(outputs), []
    for node in reversed(nodes):
        if needed.intersection(node.output):
            keep.append(node)
            needed.update(name for name in node.input if name)
    return keep[::-1]


def _copy(message):
    duplicate = type(message)()
    duplicate.CopyFrom(message)
    return duplicate
