"""Activation smoothing before int8 (SmoothQuant, Xiao et al. 2023) for ORT's dynamic quantisation.

ORT quantises a MatMul's input with one scale for the whole tensor, chosen at run time from its range,
and a trained BERT has a few hidden channels 10-30x larger than the rest (all-MiniLM-L6-v2: channels
99, 62 and 223 reach 28 where the median channel stays under 2), so those few set the step for all.
Per input channel j we divide the input by s_j (an inserted Mul) and multiply the weight's row j by
s_j: the fp32 product is unchanged, and the outliers move into the weights, which are quantised per
output channel. s_j = max|x_j|^ALPHA / max|W_j|^(1 - ALPHA), max|x_j| measured on calibration feeds.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

# Share of the difficulty moved into the weights. all-MiniLM-L6-v2's min mean-pooled cosine to fp32 on
# the gate's batches: 0.5 -> 0.985, 0.6 -> 0.992, 0.7 -> 0.9925, 0.8 -> 0.989 (BENCHMARKS.md, "int8").
ALPHA = 0.7


def smooth_activations(model: onnx.ModelProto, feeds: Sequence[dict[str, np.ndarray]],
                       exclude: Sequence[str] = ()) -> int:
    """Smooth, in place, the input of every MatMul with a 2-D constant weight and every Attention node
    (its input projection) of `model`, fp32 and fused, that `exclude` does not name; ranges measured on
    `feeds` (padded batches with an attention_mask; padding left out). Returns the nodes smoothed."""
    graph = model.graph
    weights = {init.name: init for init in graph.initializer}
    targets = [n for n in graph.node if n.name not in exclude and n.op_type in ("MatMul", "Attention")
               and n.input[1] in weights and len(weights[n.input[1]].dims) == 2]
    input_max = _channel_max(model, sorted({n.input[0] for n in targets}), feeds)
    for node in targets:
        weight = numpy_helper.to_array(weights[node.input[1]])  # [K, N]: row j meets input channel j
        scale = (np.maximum(input_max[node.input[0]], 1e-5) ** ALPHA
                 / np.maximum(np.abs(weight).max(1), 1e-5) ** (1 - ALPHA)).astype(np.float32)  # [K]
        weights[node.input[1]].CopyFrom(numpy_helper.from_array(weight * scale[:, None], node.input[1]))
        inverse, smoothed = f"{node.name}_smooth_inverse", f"{node.name}_smoothed_input"
        graph.initializer.append(numpy_helper.from_array(1.0 / scale, inverse))
        mul = helper.make_node("Mul", [node.input[0], inverse], [smoothed], name=f"{node.name}_smooth")
        node.input[0] = smoothed
        graph.node.insert(list(graph.node).index(node), mul)  # keeps the graph topologically sorted
    return len(targets)


def _channel_max(model: onnx.ModelProto, names: list[str], feeds) -> dict[str, np.ndarray]:
    """Per tensor name ([batch, sequence, channels] inside `model`), max |value| per channel over the
    real tokens of every feed."""
    import onnxruntime as ort

    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    probe.graph.ClearField("output")
    probe.graph.output.extend(helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names)
    session = ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])
    found = {name: 0.0 for name in names}
    for feed in feeds:
        real = feed["attention_mask"].astype(bool)
        for name, value in zip(names, session.run(names, feed)):
            found[name] = np.maximum(found[name], np.abs(value[real]).max(0))  # [B, S, K] -> [K]
    return found
