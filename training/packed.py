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
    """Where each sequence lies in a [T, ...] packed tensor: sequence i is rows cu_seqlens[i]:cu_seqlens[i+1].
    The batch's `sequences` come first; any after them are filler (see pack's `token_multiple`)."""

    cu_seqlens: torch.Tensor  # [sequences + fillers + 1] int32 offsets, starting at 0
    max_len: int  # no sequence is longer (sizes the attention kernel's grid; the padded width, not the
    # batch's longest, so that it stays one constant and a compiled model never specialises on it)
    position_ids: torch.Tensor  # [T] position of each token in its own sequence
    sequences: int  # the batch's sequences (rows of its heads' outputs)

    @property
    def first_tokens(self) -> torch.Tensor:
        """[B] row of each sequence's [CLS] token."""
        return self.cu_seqlens[:self.sequences].long()

    @property
    def fillers(self) -> int:
        return self.cu_seqlens.shape[0] - 1 - self.sequences


class QueryRows(NamedTuple):
    """The packed rows a layer computes outputs for, the same number from every sequence, sequence by
    sequence. Pre-training reads the last layer at [CLS] and the masked positions only (about a sixth
    of the tokens), so that layer needs keys and values of every token but queries of these rows alone."""

    index: torch.Tensor  # [B * per_sequence] rows of the packed [T, ...] tensors
    per_sequence: int
    fillers: int = 0  # filler sequences after the batch's: keys and values, no query rows

    @classmethod
    def for_heads(cls, packed: PackedSequences, masked_positions: torch.Tensor) -> "QueryRows":
        """[CLS] of each sequence, then its P masked rows: [B, 1 + P] as one flat index. Unused mask
        slots point at [CLS] again; their outputs are computed and ignored (labels -100)."""
        index = torch.cat([packed.first_tokens[:, None], masked_positions], dim=1)  # [B, 1 + P]
        return cls(index.flatten(), index.shape[1], packed.fillers)

    @property
    def sequences(self) -> int:
        return self.index.shape[0] // self.per_sequence

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """Offsets with one entry per sequence of the keys' layout: the fillers' query rows are empty."""
        count = self.sequences
        offsets = torch.arange(count + 1, device=self.index.device, dtype=torch.int32) * self.per_sequence
        return F.pad(offsets, (0, self.fillers), value=count * self.per_sequence)


def pack(attention_mask: torch.Tensor, token_multiple: int | None = None) -> tuple[torch.Tensor, PackedSequences]:
    """[B, S] 1/0 mask of right-padded rows -> (flat indices of the real tokens [T], their layout).

    `token_multiple`: the layout is filled up to a multiple of that many tokens with filler sequences
    after the batch's (the caller appends their tokens: `PackedSequences.cu_seqlens[-1] - T` of them), so
    that the token count takes few distinct values (a CUDA graph is recorded for each). Fillers attend
    among themselves only and no head reads them; each is 1 to S tokens long, and their number is fixed
    by S and the multiple, so that every batch has the same number of sequences."""
    real = attention_mask.bool()
    lengths = real.sum(1, dtype=torch.int32)
    if not bool((real == (torch.arange(real.shape[1]) < lengths[:, None])).all()):
        raise ValueError("packing expects right-padded rows (every mask a run of 1s then 0s)")
    if not bool((lengths > 0).all()):
        raise ValueError("packing needs every row to hold at least one token")
    token_index = real.flatten().nonzero().squeeze(1)  # [T]
    position_ids = torch.arange(real.shape[1]).expand_as(real)[real]  # [T]
    if token_multiple:
        fillers = filler_lengths(int(lengths.sum()), token_multiple, real.shape[1])
        lengths = torch.cat([lengths, fillers])
        position_ids = torch.cat([position_ids, *(torch.arange(int(n)) for n in fillers)])
    cu_seqlens = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0))
    return token_index, PackedSequences(cu_seqlens, real.shape[1], position_ids, real.shape[0])


def filler_lengths(tokens: int, token_multiple: int, width: int) -> torch.Tensor:
    """Lengths (1 to width each) of the filler sequences that take `tokens` to a multiple of
    `token_multiple`: always the same number of them, the fewest that can hold up to token_multiple - 1
    tokens beyond one each."""
    if width < 2:
        raise ValueError(f"filling to a token multiple needs sequences of at least 2 tokens, not {width}")
    count = max(1, -(-(token_multiple - 1) // (width - 1)))  # ceil: count * width >= count + multiple - 1
    extra = count + (-(tokens + count)) % token_multiple
    base, longer = divmod(extra, count)
    return torch.tensor([base + 1] * longer + [base] * (count - longer), dtype=torch.int32)


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
    keys, values = padded(k), padded(v)
    if queries is not None:  # already a regular [B, per_sequence] grid, for the batch's sequences only
        rows = queries.sequences
        q_grid = q.view(rows, queries.per_sequence, heads, size).transpose(1, 2)
        keys, values, keep = keys[:rows], values[:rows], keep[:rows]
    else:
        q_grid = padded(q)
    ctx = F.scaled_dot_product_attention(q_grid, keys, values, attn_mask=keep[:, None, None, :],
                                         dropout_p=dropout_p)  # [B, nh, width or per_sequence, hd]
    ctx = ctx.transpose(1, 2).flatten(0, 1)  # [B * (width or per_sequence), nh, hd]
    return ctx.index_select(0, slot) if queries is None else ctx
