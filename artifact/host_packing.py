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
    return HostPacker(rows, width).pack(lengths, ids, type_ids, tokens, pad_id)


class HostPacker:
    """pack_on_host for buckets of `rows` rows and width `width`, into arrays of its own that the next
    `pack` overwrites (one thread at a time; copy or upload them first). A batch writes only its own rows'
    token offsets: those of the rows past it, all padding, are each place's own index (row * width +
    position, in order) and stay in place from batch to batch. For a 75-text batch in a 256-row bucket of
    width 512 that is 38k of the 131k offsets."""

    def __init__(self, rows: int, width: int):
        self.rows, self.width = rows, width
        self._places = np.arange(rows * width, dtype=np.int32)  # every place's own index
        self._offset = self._places.copy()
        self._written = 0  # offsets before this one were written by the last batch; the rest are `_places`
        self._cumulative = np.zeros(rows + 1, np.int32)
        self._cls = np.zeros(rows, np.int32)
        self._tokens: dict[int, np.ndarray] = {}  # bucket tokens -> its [3, tokens] array

    def pack(self, lengths: np.ndarray, ids: np.ndarray | None, type_ids: np.ndarray | None, tokens: int,
             pad_id: int) -> tuple[np.ndarray, ...]:
        rows, width = self.rows, self.width
        n, count = len(lengths), int(lengths.sum())
        if n > rows or count > tokens or (n and int(lengths.max()) > width):
            raise ValueError(f"{n} rows of {count} tokens (longest {int(lengths.max()) if n else 0}) do not fit a "
                             f"bucket of {rows} rows, {tokens} tokens and width {width}")
        real = np.asarray(lengths, np.int32)  # int32 throughout: np.repeat of int64 is several times slower
        cumulative = self._cumulative
        np.cumsum(real, out=cumulative[1:n + 1])
        cumulative[n + 1:] = count
        starts = cumulative[:n]  # each row's first token
        packed = self._tokens.get(tokens)
        if packed is None:
            packed = self._tokens[tokens] = np.empty((3, tokens), np.int32)
        packed[0, :count] = pad_id if ids is None else ids
        packed[1, :count] = 0 if type_ids is None else type_ids
        packed[0, count:], packed[1:, count:] = pad_id, 0
        positions = packed[2, :count]
        np.subtract(self._places[:count], np.repeat(starts, real), out=positions)
        offset, row_base = self._offset, self._places[:n * width:width]  # row_base: each row's first place
        np.add(np.repeat(row_base, real), positions, out=offset[:count])
        # the padding places of the batch's rows, row after row: row b's run starts at b * width + its length
        pads = width - real
        runs = row_base + real - (np.cumsum(pads, dtype=np.int32) - pads)
        end = n * width
        np.add(np.repeat(runs, pads), self._places[:end - count], out=offset[count:end])
        if self._written > end:  # the last batch had more rows: theirs are filler again
            offset[end:self._written] = self._places[end:self._written]
        self._written = end
        cls = self._cls
        cls[:n], cls[n:] = starts, 0  # a filler row reads token 0
        return packed, offset.reshape(rows, width), cumulative, cls
