"""The inputs of a host-packed graph (export/host_packing.py writes it, app/cuda_graphs.py replays it): the
batch's real tokens one after another, made on the host so that the graph's shapes follow buckets the
server picks and CUDA can replay it. Numpy only: both export and the server use it.

  tokens                      [3, tokens] int32: token ids, token type ids, positions within the sequence
  token_offset                [rows, width] int32: each real token's place in a [rows, width] padding
                              (row * width + position) in packed order, then the padding places in order,
                              as ORT's RemovePadding makes it (bert_padding.cu, getTokenOffset)
  cumulative_sequence_length  [rows + 1] int32: 0, then the running sum of the rows' lengths
  cls_positions               [rows] int32: each row's first token ([CLS]); 0 for a row past the batch's

A bucket may hold more rows and tokens than the batch: the rows past it are empty (length 0, no token
attends to them), the tokens past it are [PAD] filler that no row reads.
"""
from __future__ import annotations

import numpy as np

TOKENS, TOKEN_OFFSET, CUMULATIVE_LENGTHS, CLS_POSITIONS = ("tokens", "token_offset", "cumulative_sequence_length",
                                                           "cls_positions")
HOST_PACKED_INPUTS = (TOKENS, TOKEN_OFFSET, CUMULATIVE_LENGTHS, CLS_POSITIONS)


def pack_on_host(lengths: np.ndarray, ids: np.ndarray | None, type_ids: np.ndarray | None, rows: int, tokens: int,
                 width: int, pad_id: int) -> tuple[np.ndarray, ...]:
    """The inputs above, in HOST_PACKED_INPUTS order, for rows of these `lengths` (each at most `width`)
    whose real tokens, one row after another, are `ids` / `type_ids` (None: [PAD] everywhere), in a bucket
    of `rows` rows and `tokens` tokens."""
    n, count = len(lengths), int(lengths.sum())
    if n > rows or count > tokens or (n and int(lengths.max()) > width):
        raise ValueError(f"{n} rows of {count} tokens (longest {int(lengths.max()) if n else 0}) do not fit a "
                         f"bucket of {rows} rows, {tokens} tokens and width {width}")
    # int32 throughout: np.repeat of int64 counts and values is several times slower
    all_lengths = np.zeros(rows, np.int32)
    all_lengths[:n] = lengths
    cumulative = np.zeros(rows + 1, np.int32)
    np.cumsum(all_lengths, out=cumulative[1:])
    starts = cumulative[:-1]  # each row's first token
    packed = np.zeros((3, tokens), np.int32)
    packed[0] = pad_id
    if ids is not None:
        packed[0, :count], packed[1, :count] = ids, type_ids
    real = all_lengths[:n]
    packed[2, :count] = np.arange(count, dtype=np.int32) - np.repeat(starts[:n], real)
    row_base = np.arange(rows, dtype=np.int32) * width  # each row's first place in the padding
    offset = np.empty(rows * width, np.int32)
    offset[:count] = np.repeat(row_base[:n], real) + packed[2, :count]
    # the padding places, row after row: row b's run starts at b * width + its length
    pads = width - all_lengths
    runs = row_base + all_lengths - (np.cumsum(pads, dtype=np.int32) - pads)
    offset[count:] = np.repeat(runs, pads) + np.arange(rows * width - count, dtype=np.int32)
    cls = starts.copy()
    cls[n:] = 0  # a filler row reads token 0
    return packed, offset.reshape(rows, width), cumulative, cls
