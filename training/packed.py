"""Training without padding: the sequences of a batch laid end to end, and attention over that layout.

A padded batch of real pre-training data is about a third padding (the default corpus: 64% of the
[B, 128] slots hold tokens), and a padded encoder spends its matrix products and elementwise work on
those slots as on real ones. Packed, every layer runs on [T, H] (T = real tokens only) and attention
keeps the sequences apart with cumulative offsets instead of a mask.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F


class PackedSequences(NamedTuple):
    """Where each sequence lies in a [T, ...] packed tensor: sequence i is rows cu_seqlens[i]:cu_seqlens[i+1]."""

    cu_seqlens: torch.Tensor  # [B+1] int32 offsets, starting at 0
    max_len: int  # no sequence is longer (sizes the attention kernel's grid; the padded width, not the
    # batch's longest, so that it stays one constant and a compiled model never specialises on it)
    position_ids: torch.Tensor  # [T] position of each token in its own sequence

    @property
    def first_tokens(self) -> torch.Tensor:
        """[B] row of each sequence's [CLS] token."""
        return self.cu_seqlens[:-1].long()


def pack(attention_mask: torch.Tensor) -> tuple[torch.Tensor, PackedSequences]:
    """[B, S] 1/0 mask of right-padded rows -> (flat indices of the real tokens [T], their layout)."""
    real = attention_mask.bool()
    lengths = real.sum(1, dtype=torch.int32)
    if not bool((real == (torch.arange(real.shape[1]) < lengths[:, None])).all()):
        raise ValueError("packing expects right-padded rows (every mask a run of 1s then 0s)")
    if not bool((lengths > 0).all()):
        raise ValueError("packing needs every row to hold at least one token")
    token_index = real.flatten().nonzero().squeeze(1)  # [T]
    cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    position_ids = torch.arange(real.shape[1]).expand_as(real)[real]  # [T]
    return token_index, PackedSequences(cu_seqlens, real.shape[1], position_ids)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedSequences,
                     dropout_p: float) -> torch.Tensor:
    """Softmax attention within each packed sequence. q, k, v: [T, heads, head_size] -> [T, heads, head_size].

    On a CUDA device in fp16/bf16 this is FlashAttention's variable-length kernel (autograd and
    torch.compile know it: nested-tensor SDPA runs on it). Elsewhere the sequences are scattered back
    into a padded batch for scaled_dot_product_attention: same result, none of the saving."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        cu = packed.cu_seqlens
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, packed.max_len, packed.max_len, dropout_p, False, False)[0]
    return _padded_attention(q, k, v, packed, dropout_p)


def _padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedSequences,
                      dropout_p: float) -> torch.Tensor:
    t, heads, size = q.shape
    lengths = packed.cu_seqlens.diff().long()
    b, width = lengths.numel(), packed.max_len
    sequence = torch.repeat_interleave(torch.arange(b, device=q.device), lengths, output_size=t)  # [T]
    slot = sequence * width + packed.position_ids  # row of each token in the [B * width] padded layout

    def padded(x: torch.Tensor) -> torch.Tensor:  # [T, nh, hd] -> [B, nh, width, hd]
        return x.new_zeros(b * width, heads, size).index_copy(0, slot, x).view(b, width, heads, size).transpose(1, 2)

    keep = torch.arange(width, device=q.device) < lengths[:, None]  # [B, width]
    ctx = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=keep[:, None, None, :],
                                         dropout_p=dropout_p)  # [B, nh, width, hd]
    return ctx.transpose(1, 2).reshape(b * width, heads, size).index_select(0, slot)
