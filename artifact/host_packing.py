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

A packer writes all four into one int32 array (`FlatLayout`), so that a replay copies a batch to the GPU
in one copy, not four.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

TOKENS, TOKEN_OFFSET, CUMULATIVE_LENGTHS, CLS_POSITIONS = ("tokens", "token_offset", "cumulative_sequence_length",
                                                           "cls_positions")
HOST_PACKED_INPUTS = (TOKENS, TOKEN_OFFSET, CUMULATIVE_LENGTHS, CLS_POSITIONS)


_ALIGN = 64  # each input starts 256 bytes into the flat array: as aligned as an allocation of its own


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass(frozen=True)
class FlatLayout:
    """Where each input lies in the one int32 array that holds a bucket's four, as element offsets:
    token_offset first (it depends on the rows and width only), then cumulative_sequence_length and
    cls_positions, then tokens, whose length depends on the bucket's token count (`size`)."""
    rows: int
    width: int

    @property
    def cumulative(self) -> int:
        return _aligned(self.rows * self.width)

    @property
    def cls(self) -> int:
        return _aligned(self.cumulative + self.rows + 1)

    @property
    def tokens(self) -> int:
        return _aligned(self.cls + self.rows)

    def size(self, tokens: int) -> int:
        """Elements of the flat array for a bucket of `tokens` tokens."""
        return self.tokens + 3 * tokens

    def offsets(self, tokens: int) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Each input's (element offset, shape), in HOST_PACKED_INPUTS order."""
        return {TOKENS: (self.tokens, (3, tokens)), TOKEN_OFFSET: (0, (self.rows, self.width)),
                CUMULATIVE_LENGTHS: (self.cumulative, (self.rows + 1,)), CLS_POSITIONS: (self.cls, (self.rows,))}


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
        self.layout = FlatLayout(rows, width)
        self._places = np.arange(rows * width, dtype=np.int32)  # every place's own index
        self._written = 0  # offsets before this one were written by the last batch; the rest are `_places`
        self._flat = np.zeros(self.layout.size(0), np.int32)
        self._flat[:rows * width] = self._places
        self._views: dict[int, tuple[np.ndarray, ...]] = {}  # bucket tokens -> the inputs' views of _flat

    def flat(self, tokens: int) -> np.ndarray:
        """What the last `pack` (into a bucket of these `tokens`) wrote: all four inputs, where `layout` places
        them, in one array, for one copy to the GPU."""
        return self._flat[:self.layout.size(tokens)]

    def _arrays(self, tokens: int) -> tuple[np.ndarray, ...]:
        """Views of the flat array, in HOST_PACKED_INPUTS order; it grows to hold `tokens` tokens."""
        views = self._views.get(tokens)
        if views is None:
            size = self.layout.size(tokens)
            if len(self._flat) < size:
                grown = np.zeros(size, np.int32)
                grown[:self.layout.tokens] = self._flat[:self.layout.tokens]
                self._flat, self._views = grown, {}
            views = self._views[tokens] = tuple(self._flat[at:at + int(np.prod(shape))].reshape(shape)
                                                for at, shape in self.layout.offsets(tokens).values())
        return views

    def pack(self, lengths: np.ndarray, ids: np.ndarray | None, type_ids: np.ndarray | None, tokens: int,
             pad_id: int) -> tuple[np.ndarray, ...]:
        rows, width = self.rows, self.width
        n, count = len(lengths), int(lengths.sum())
        if n > rows or count > tokens or (n and int(lengths.max()) > width):
            raise ValueError(f"{n} rows of {count} tokens (longest {int(lengths.max()) if n else 0}) do not fit a "
                             f"bucket of {rows} rows, {tokens} tokens and width {width}")
        real = np.asarray(lengths, np.int32)  # int32 throughout: np.repeat of int64 is several times slower
        packed, offset, cumulative, cls = self._arrays(tokens)
        np.cumsum(real, out=cumulative[1:n + 1])
        cumulative[n + 1:] = count
        starts = cumulative[:n]  # each row's first token
        packed[0, :count] = pad_id if ids is None else ids
        packed[1, :count] = 0 if type_ids is None else type_ids
        packed[0, count:], packed[1:, count:] = pad_id, 0
        positions = packed[2, :count]
        np.subtract(self._places[:count], np.repeat(starts, real), out=positions)
        offset = offset.reshape(-1)
        row_base = self._places[:n * width:width]  # each row's first place
        np.add(np.repeat(row_base, real), positions, out=offset[:count])
        # the padding places of the batch's rows, row after row: row b's run starts at b * width + its length
        pads = width - real
        runs = row_base + real - (np.cumsum(pads, dtype=np.int32) - pads)
        end = n * width
        np.add(np.repeat(runs, pads), self._places[:end - count], out=offset[count:end])
        if self._written > end:  # the last batch had more rows: theirs are filler again
            offset[end:self._written] = self._places[end:self._written]
        self._written = end
        cls[:n], cls[n:] = starts, 0  # a filler row reads token 0
        return packed, offset.reshape(rows, width), cumulative, cls
