"""Graph feeds built from real tokenizer encodings, shared by the tests that run exported graphs."""
from __future__ import annotations

import numpy as np
from tokenizers import Encoding


def padded_feed(encodings: list[Encoding]) -> dict[str, np.ndarray]:
    """input_ids / attention_mask / token_type_ids, [rows, longest] int64, right-padded with 0."""
    width = max(len(e.ids) for e in encodings)
    feed = {k: np.zeros((len(encodings), width), dtype=np.int64)
            for k in ("input_ids", "attention_mask", "token_type_ids")}
    for row, e in enumerate(encodings):
        feed["input_ids"][row, :len(e.ids)] = e.ids
        feed["attention_mask"][row, :len(e.ids)] = 1
        feed["token_type_ids"][row, :len(e.ids)] = e.type_ids
    return feed
