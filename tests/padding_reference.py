"""What ONNX Runtime's RemovePadding gives, written out: the reference for host packing
(artifact/host_packing.py) and for our RemovePadding operator (custom_kernels/src/remove_padding.cc)."""
from __future__ import annotations


def ort_token_offset(lengths: list[int], width: int) -> tuple[list[int], list[int]]:
    """ONNX Runtime's RemovePadding on the GPU (bert_padding.cu, getTokenOffset), line by line: the token
    offsets (real tokens in order, then the padding in order) and the cumulative lengths."""
    offset, cumulative = [], [0]
    for i, count in enumerate(lengths):
        cumulative.append(cumulative[-1] + count)
        offset += [i * width + j for j in range(count)]
    for i, count in enumerate(lengths):
        offset += [i * width + count + j for j in range(width - count)]
    return offset, cumulative
