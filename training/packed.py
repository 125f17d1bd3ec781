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


class QueryRows(NamedTuple):
    """The packed rows a layer computes outputs for, the same number from every sequence, sequence by
    sequence. Pre-training reads the last layer at [CLS] and the masked positions only (about a sixth
    of the tokens), so that layer needs keys and values of every token but queries of these rows alone."""

    index: torch.Tensor  # [B * per_sequence] rows of the packed [T, ...] tensors
    per_sequence: int

    @classmethod
    def for_heads(cls, packed: PackedSequences, masked_positions: torch.Tensor) -> "QueryRows":
        """[CLS] of each sequence, then its P masked rows: [B, 1 + P] as one flat index. Unused mask
        slots point at [CLS] again; their outputs are computed and ignored (labels -100)."""
        index = torch.cat([packed.first_tokens[:, None], masked_positions], dim=1)  # [B, 1 + P]
        return cls(index.flatten(), index.shape[1])

    @property
    def cu_seqlens(self) -> torch.Tensor:
        count = self.index.shape[0] // self.per_sequence
        return torch.arange(count + 1, device=self.index.device, dtype=torch.int32) * self.per_sequence


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
                     dropout_p: float, queries: QueryRows | None = None) -> torch.Tensor:
    """Softmax attention within each packed sequence. k, v: [T, heads, head_size]; q: the same rows, or
    those of `queries` -> [rows of q, heads, head_size].

    On a CUDA device in fp16/bf16 this is FlashAttention's variable-length kernel (autograd and
    torch.compile know it: nested-tensor SDPA runs on it). Elsewhere the sequences are scattered back
    into a padded batch for scaled_dot_product_attention: same result, none of the saving."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        cu_q, max_q = (packed.cu_seqlens, packed.max_len) if queries is None else (queries.cu_seqlens,
                                                                                   queries.per_sequence)
        return torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, packed.cu_seqlens, max_q, packed.max_len, dropout_p, False, False)[0]
    return _padded_attention(q, k, v, packed, dropout_p, queries)


def _padded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packed: PackedSequences,
                      dropout_p: float, queries: QueryRows | None) -> torch.Tensor:
    t, heads, size = k.shape
    lengths = packed.cu_seqlens.diff().long()
    b, width = lengths.numel(), packed.max_len
    sequence = torch.repeat_interleave(torch.arange(b, device=q.device), lengths, output_size=t)  # [T]
    slot = sequence * width + packed.position_ids  # row of each token in the [B * width] padded layout

    def padded(x: torch.Tensor) -> torch.Tensor:  # [T, nh, hd] -> [B, nh, width, hd]
        return x.new_zeros(b * width, heads, size).index_copy(0, slot, x).view(b, width, heads, size).transpose(1, 2)

    keep = torch.arange(width, device=q.device) < lengths[:, None]  # [B, width]
    # Query rows of a QueryRows are already a regular [B, per_sequence] grid.
    q_grid = padded(q) if queries is None else q.view(b, queries.per_sequence, heads, size).transpose(1, 2)
    ctx = F.scaled_dot_product_attention(q_grid, padded(k), padded(v), attn_mask=keep[:, None, None, :],
                                         dropout_p=dropout_p)  # [B, nh, width or per_sequence, hd]
    ctx = ctx.transpose(1, 2).flatten(0, 1)  # [B * (width or per_sequence), nh, hd]
    return ctx.index_select(0, slot) if queries is None else ctx
