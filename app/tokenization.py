"""Text (or text pair) -> token ids, type ids and character offsets, with the checks that belong here:
empty, whitespace-only, over-long and un-encodable inputs are rejected naming their index."""
from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Encoding, Tokenizer, normalizers

from app.errors import InputTooLong, InvalidInput

Item = str | tuple[str, str]  # a text, or a sentence pair [CLS] A [SEP] B [SEP]

# When truncating a long text, tokenise a prefix of about this many characters per allowed token first:
# a 1 MB text costs seconds to tokenise in full but only its first few hundred tokens are kept.
_PREFIX_CHARS_PER_TOKEN = 16
_CUT_CHARS = (" ", "\n", "\t", "\r")
# What BertNormalizer's clean_text removes from ASCII text (tab, newline and carriage return it only turns
# into spaces, which the pre-tokenizer splits on alike).
_ASCII_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")


@dataclass(frozen=True, slots=True)
class Encoded:
    """One input, tokenised: what the batcher needs plus the encoding for offsets / token strings."""
    ids: np.ndarray  # [n] int64, specials included
    type_ids: np.ndarray  # [n] int64, 0 for text_a, 1 for text_b
    encoding: Encoding

    @property
    def length(self) -> int:
        return len(self.ids)


class TextTokenizer:
    """Wraps the artifact's tokenizer.json; safe to call from several threads at once."""

    def __init__(self, path: Path, max_length: int, max_input_chars: int, special_tokens: dict[str, int]):
        self.max_length = max_length
        self.max_input_chars = max_input_chars
        self._full = _load(path, max_length, truncate=False)  # no truncation: for exact lengths
        self._truncating = _load(path, max_length, truncate=True)
        # The same tokenizers with BertNormalizer replaced by what it does to plain ASCII text: half the
        # tokenising time per text, same ids, offsets and tokens (None: some other normalizer).
        ascii_normalizer = _ascii_equivalent(path)
        self._ascii_full = self._ascii_truncating = None
        if ascii_normalizer is not None:
            self._ascii_full = _load(path, max_length, truncate=False, normalizer=ascii_normalizer)
            self._ascii_truncating = _load(path, max_length, truncate=True, normalizer=ascii_normalizer)
        for token, expected in special_tokens.items():
            found = self._full.token_to_id(token)
            if found != expected:
                raise ValueError(f"tokenizer.json gives {token} the id {found}, the manifest says {expected}: "
                                 f"the artifact's files do not belong together; re-export it")
        probe = self._full.encode("a", "b")
        if probe.type_ids[-1] != 1:
            raise ValueError("tokenizer.json has no BERT pair template (segment ids); re-export the artifact")

    # -- checks -----------------------------------------------------------------------------------------
    def _check_text(self, text: str, where: str) -> None:
        if not text:
            raise InvalidInput(f"{where} is an empty string")
        if text.isspace():
            raise InvalidInput(f"{where} contains only whitespace")
        if len(text) > self.max_input_chars:
            raise InputTooLong(f"{where} has {len(text)} characters; the server accepts at most "
                               f"{self.max_input_chars} per text")

    def check(self, items: Sequence[Item], field: str) -> None:
        for i, item in enumerate(items):
            if isinstance(item, str):
                self._check_text(item, f"{field}[{i}]")
            else:
                self._check_text(item[0], f"{field}[{i}][0] (text_a)")
                self._check_text(item[1], f"{field}[{i}][1] (text_b)")

    # -- encoding ---------------------------------------------------------------------------------------
    def _prefix(self, text: str) -> str:
        """The shortest whitespace-cut prefix with at least max_length tokens, or the text itself.
        Cut at whitespace, words before the cut tokenise exactly as in the whole text, so truncating
        the prefix gives the same tokens as truncating the text."""
        limit = self.max_length * _PREFIX_CHARS_PER_TOKEN
        while limit < len(text):
            cut = max(text.rfind(c, limit // 2, limit) for c in _CUT_CHARS)
            if cut <= 0:
                return text
            if len(self._full.encode(text[:cut], add_special_tokens=False).ids) >= self.max_length:
                return text[:cut]
            limit *= 4
        return text

    def _plain_ascii(self, items: Sequence[Item]) -> bool:
        """Every text is ASCII without the control characters BertNormalizer removes."""
        return self._ascii_full is not None and all(
            part.isascii() and not _ASCII_CONTROL.search(part)
            for item in items for part in ((item,) if isinstance(item, str) else item))

    def encode(self, items: Sequence[Item], truncate: bool, field: str = "inputs",
               offsets: bool = True) -> list[Encoded]:
        """Blocking (run it in a thread: `encode_batch` releases the GIL). Raises InvalidInput /
        InputTooLong naming the index. offsets=False: every offset is (0, 0), and tokenising costs less."""
        self.check(items, field)
        plain = self._plain_ascii(items)
        if truncate:
            batch = [self._prefix(x) if isinstance(x, str) else x for x in items]
            tokenizer = self._ascii_truncating if plain else self._truncating
        else:
            for i, x in enumerate(items):  # answer "too long" for a huge text without tokenising all of it
                if isinstance(x, str) and len(x) > self.max_length * _PREFIX_CHARS_PER_TOKEN:
                    prefix = self._prefix(x)
                    if prefix is not x:
                        raise InputTooLong(f"{field}[{i}] is too long: its first {len(prefix)} of {len(x)} "
                                           f"characters already make more than the {self.max_length} tokens the "
                                           f"model accepts (send truncate: true to cut it)")
            batch = list(items)
            tokenizer = self._ascii_full if plain else self._full
        try:
            encodings = _encode_all(tokenizer, batch, offsets)
        except Exception as e:  # lone surrogates ("\ud800") and the like cannot become UTF-8
            for i, item in enumerate(items):
                for part in ([item] if isinstance(item, str) else item):
                    try:
                        part.encode("utf-8")
                    except UnicodeEncodeError as ue:
                        raise InvalidInput(f"{field}[{i}] is not valid Unicode text ({ue.reason} at "
                                           f"character {ue.start})") from None
            raise InvalidInput(f"{field} could not be tokenised: {e}") from e
        out = []
        for i, enc in enumerate(encodings):
            ids = enc.ids  # each read builds a new list: read once
            n = len(ids)
            if n > self.max_length:  # only when truncate is false
                raise InputTooLong(f"{field}[{i}] has {n} tokens; the model accepts at most {self.max_length} "
                                   f"(send truncate: true to cut it)")
            if all(enc.special_tokens_mask):
                raise InvalidInput(f"{field}[{i}] has no tokens after normalisation (only control or "
                                   f"ignored characters?)")
            out.append(Encoded(np.array(ids, dtype=np.int64), np.array(enc.type_ids, dtype=np.int64), enc))
        return out


def _load(path: Path, max_length: int, truncate: bool,
          normalizer: normalizers.Normalizer | None = None) -> Tokenizer:
    tokenizer = Tokenizer.from_file(str(path))
    tokenizer.no_padding()
    if truncate:
        tokenizer.enable_truncation(max_length, strategy="longest_first")
    else:
        tokenizer.no_truncation()
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    return tokenizer


def _ascii_equivalent(path: Path) -> normalizers.Normalizer | None:
    """A normalizer that does to ASCII text without control characters what the tokenizer's BertNormalizer
    does (accents and Chinese characters are not ASCII; clean_text only turns tab, newline and carriage
    return into spaces there): lower-casing, or else nothing at all. None for any other normalizer, or
    when an added token is matched after normalisation (where the two could differ)."""
    config = json.loads(path.read_text(encoding="utf-8"))
    bert = config.get("normalizer") or {}
    if bert.get("type") != "BertNormalizer" or any(t.get("normalized") for t in config.get("added_tokens", ())):
        return None
    return normalizers.Lowercase() if bert.get("lowercase") else normalizers.Sequence([])


def _encode_all(tokenizer: Tokenizer, batch: list[Item], offsets: bool) -> list[Encoding]:
    """encode_batch spreads over a thread pool, whose hand-off costs more than one short text."""
    if not offsets:  # no offset tracking: the cheapest call, even for one text
        return tokenizer.encode_batch_fast(batch)
    if len(batch) == 1:
        item = batch[0]
        return [tokenizer.encode(item) if isinstance(item, str) else tokenizer.encode(*item)]
    return tokenizer.encode_batch(batch)


def describe_tokens(encoded: Encoded) -> list[dict]:
    """Per token: id, token, segment (0: text_a, 1: text_b), character start/end in ITS text, special."""
    enc = encoded.encoding
    return [
        {"id": i, "token": t, "segment": s, "start": o[0], "end": o[1], "special": bool(sp)}
        for i, t, s, o, sp in zip(enc.ids, enc.tokens, enc.type_ids, enc.offsets, enc.special_tokens_mask)
    ]
