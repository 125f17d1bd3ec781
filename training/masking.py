"""Masked-LM corruption of one sequence: pick round(masked_lm_prob × real tokens) positions (whole words
optionally); of those 80% become [MASK], 10% a random token, 10% stay; labels hold the originals there
and -100 elsewhere. The caller passes the random generator, so masks are drawn anew per example.
"""
from __future__ import annotations

import numpy as np
from tokenizers import Tokenizer

from training.wordpiece import MASK, SPECIAL_TOKENS

IGNORE_INDEX = -100  # label of positions that are not predicted (torch cross_entropy's default)


def num_to_predict(n_candidates: int, masked_lm_prob: float, max_predictions: int) -> int:
    """How many positions a sequence with `n_candidates` maskable tokens gets (0 only if it has none)."""
    if n_candidates == 0:
        return 0
    return min(max_predictions, n_candidates, max(1, round(n_candidates * masked_lm_prob)))


class Masker:
    def __init__(self, tokenizer: Tokenizer, masked_lm_prob: float = 0.15, max_predictions: int = 20,
                 whole_word: bool = False):
        vocab = tokenizer.get_vocab()
        size = max(vocab.values()) + 1  # not the token count: a vocab.txt with a token twice skips an id
        self.masked_lm_prob, self.max_predictions, self.whole_word = masked_lm_prob, max_predictions, whole_word
        self.mask_id = vocab[MASK]
        # Special tokens (and [UNK]) are never chosen nor drawn as a random replacement.
        self.is_special = np.zeros(size, dtype=bool)
        self.is_special[[vocab[t] for t in SPECIAL_TOKENS if t in vocab]] = True
        for tok in tokenizer.get_added_tokens_decoder().values():
            if tok.special and tok.content in vocab:
                self.is_special[vocab[tok.content]] = True
        self.replacements = np.flatnonzero(~self.is_special)
        self.is_continuation = np.zeros(size, dtype=bool)  # "##ing": belongs to the word before it
        self.is_continuation[[i for t, i in vocab.items() if t.startswith("##")]] = True

    def __call__(self, input_ids: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(corrupted ids, labels) for one sequence (int64 [S], with its [CLS]/[SEP])."""
        candidates = np.flatnonzero(~self.is_special[input_ids])
        budget = num_to_predict(len(candidates), self.masked_lm_prob, self.max_predictions)
        if self.whole_word:
            chosen = self._whole_words(input_ids, candidates, budget, rng)
        else:
            chosen = np.sort(rng.permutation(candidates)[:budget])
        labels = np.full(len(input_ids), IGNORE_INDEX, dtype=np.int64)
        labels[chosen] = input_ids[chosen]
        out = input_ids.copy()
        u = rng.random(len(chosen))
        out[chosen[u < 0.8]] = self.mask_id
        random_pos = chosen[(u >= 0.8) & (u < 0.9)]  # the last 10% keep their token
        out[random_pos] = self.replacements[rng.integers(0, len(self.replacements), len(random_pos))]
        return out, labels

    def _whole_words(self, input_ids: np.ndarray, candidates: np.ndarray, budget: int,
                     rng: np.random.Generator) -> np.ndarray:
        """Whole words in random order while they fit the budget (a word that would overshoot it is
        skipped, as in the original), so at most `budget` positions."""
        if budget == 0:
            return candidates[:0]
        # A word starts at a candidate that is no "##" piece or that follows a non-candidate.
        follows_candidate = np.zeros(len(candidates), dtype=bool)
        follows_candidate[1:] = candidates[1:] == candidates[:-1] + 1
        starts = np.flatnonzero(~(self.is_continuation[input_ids[candidates]] & follows_candidate))
        words = np.split(candidates, starts[1:])
        chosen: list[np.ndarray] = []
        count = 0
        for w in rng.permutation(len(words)):
            if count >= budget:
                break
            if count + len(words[w]) > budget:
                continue
            chosen.append(words[w])
            count += len(words[w])
        return np.sort(np.concatenate(chosen)) if chosen else candidates[:0]
