"""Text (or text pair) -> token ids, type ids and character offsets, with the checks that belong here:
empty, whitespace-only, over-long and un-encodable inputs are rejected naming their index."""
from __future__ import annotations

import itertools
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Encoding, Tokenizer

from app.batcher import Sequences
from app.errors import InputTooLong, InvalidInput
from app.tokenizer_shortcuts import AsciiWords, Item, ascii_path, equivalent_parts
from artifact.manifest import TRUNCATION_DIRECTIONS

# When truncating a long text, tokenise a prefix of about this many characters per allowed token first:
# a 1 MB text costs seconds to tokenise in full but only its first few hundred tokens are kept.
_PREFIX_CHARS_PER_TOKEN = 16
_CUT_CHARS = (" ", "\n", "\t", "\r")
# CJK ideographs, as BERT's normalizer finds them (handle_chinese_chars puts spaces around each): a cut
# before one is as safe as one at whitespace, and Chinese or Japanese text has little whitespace to cut at.
# The tokenizers library's ranges, not the original BERT's: it leaves U+2B820-U+2B91F inside their words.
_CJK = ("\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002a6df\U0002a700-\U0002b73f\U0002b740-\U0002b81f"
        "\U0002b920-\U0002ceaf\U0002f800-\U0002fa1f")
_FIRST_CJK = re.compile(f"[{_CJK}]")
_LAST_CJK = re.compile(f".*([{_CJK}])", re.DOTALL)
DIRECTIONS = TRUNCATION_DIRECTIONS  # which end of an over-long input truncation cuts


@dataclass(frozen=True, slots=True)
class Encoded:
    """One input, tokenised: what the batcher needs plus the encoding for offsets / token strings."""
    ids: np.ndarray  # [n] int64, specials included
    type_ids: np.ndarray  # [n] int64, 0 for text_a, 1 for text_b
    encoding: Encoding | None  # None when tokenised without offsets by word

    @property
    def length(self) -> int:
        return len(self.ids)


@dataclass(frozen=True, slots=True)
class Tokenized:
    """A request's inputs, tokenised: their ids end to end as the batcher takes them, and each input's
    encoding for offsets / token strings."""
    sequences: Sequences
    encodings: list[Encoding] | None  # None when tokenised without offsets by word (AsciiWords)

    def __len__(self) -> int:
        return len(self.sequences.lengths)

    @property
    def tokens(self) -> int:
        return len(self.sequences.ids)

    def split(self) -> list[Encoded]:
        """One Encoded per input (views of the joined arrays)."""
        ends = np.cumsum(self.sequences.lengths).tolist()
        ids, type_ids = self.sequences.ids, self.sequences.type_ids
        encodings = self.encodings if self.encodings is not None else itertools.repeat(None)
        return [Encoded(ids[a:b], type_ids[a:b], enc) for a, b, enc in zip([0, *ends[:-1]], ends, encodings)]


class ItemNames(str):
    """A request field whose items have names of their own in error messages (TEI's /similarity embeds
    `inputs.source_sentence` and `inputs.sentences[i]` as one list); a plain field names item i `field[i]`."""

    def __new__(cls, field: str, names: Sequence[str]):
        named = super().__new__(cls, field)
        named.names = tuple(names)
        return named


def item_name(field: str, i: int) -> str:
    """How an error names item `i` of `field`."""
    return field.names[i] if isinstance(field, ItemNames) else f"{field}[{i}]"


class TokenizerFileError(ValueError):
    """The artifact's tokenizer.json cannot serve: unreadable, or not the one its manifest describes."""


class TextTokenizer:
    """Wraps the artifact's tokenizer.json; safe to call from several threads at once."""

    def __init__(self, path: Path, max_length: int, max_input_chars: int, special_tokens: dict[str, int]):
        self.max_length = max_length
        self.max_input_chars = max_input_chars
        try:
            # Read once: every tokenizer made from it, the ones made on first use too, is of this file,
            # even when the artifact's folder is exported into again while the server runs.
            text = path.read_text(encoding="utf-8")
            config = json.loads(text)
            same = equivalent_parts(config)
            self._full = _load(text, max_length, truncate=False, replace=same)  # no truncation: for exact lengths
        except Exception as e:  # tokenizers raises Exception itself for a file it cannot parse
            raise TokenizerFileError(f"{path} cannot be read as a tokenizer ({' '.join(str(e).split())}); "
                                     f"re-export the artifact") from e
        self._text, self._same = text, same
        normalizer = config.get("normalizer") or {}
        self._cjk_cuts = normalizer.get("type") == "BertNormalizer" and normalizer.get("handle_chinese_chars", True)
        self._left_truncating: dict[bool, Tokenizer] = {}  # plain ASCII or not -> made on first use
        self._truncating = _load(text, max_length, truncate=True, replace=same)
        # The same tokenizers for plain ASCII text, without BertNormalizer's and BertPreTokenizer's Unicode
        # work: about half the tokenising time per text, same ids, offsets and tokens (None: some other
        # normalizer).
        self._ascii = ascii_path(config)
        self._ascii_full = self._ascii_truncating = None
        if self._ascii is not None:
            self._ascii_full = _load(text, max_length, truncate=False, replace={**same, **self._ascii.parts})
            self._ascii_truncating = _load(text, max_length, truncate=True, replace={**same, **self._ascii.parts})
        for token, expected in special_tokens.items():
            found = self._full.token_to_id(token)
            if found != expected:
                raise TokenizerFileError(f"tokenizer.json gives {token} the id {found}, the manifest says "
                                         f"{expected}: the artifact's files do not belong together; re-export it")
        probe = self._full.encode("a", "b")
        if probe.type_ids[-1] != 1:
            raise TokenizerFileError("tokenizer.json has no BERT pair template (segment ids); re-export the "
                                     "artifact")
        # How many special tokens the template adds to a text (index 0) and to a pair (1).
        self._specials = (self._full.num_special_tokens_to_add(False), self._full.num_special_tokens_to_add(True))
        self._words = AsciiWords.of(self._ascii_full, self._ascii, max_length) if self._ascii else None

    # -- checks -----------------------------------------------------------------------------------------
    def check_text(self, text: str, where: str) -> None:
        """Raises InvalidInput / InputTooLong naming `where` (the request's own field) for a text none can embed."""
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
                self.check_text(item, item_name(field, i))
            else:
                self.check_text(item[0], f"{item_name(field, i)}[0] (text_a)")
                self.check_text(item[1], f"{item_name(field, i)}[1] (text_b)")

    # -- encoding ---------------------------------------------------------------------------------------
    def _prefix(self, text: str) -> str:
        """The shortest prefix cut at whitespace (or before a CJK ideograph) with at least max_length tokens,
        or the text itself. Cut there, words before the cut tokenise exactly as in the whole text, so
        truncating the prefix gives the same tokens as truncating the text."""
        limit = self.max_length * _PREFIX_CHARS_PER_TOKEN
        while limit < len(text):
            cut = max(text.rfind(c, limit // 2, limit) for c in _CUT_CHARS)
            if cut <= 0 and self._cjk_cuts and (last := _LAST_CJK.match(text, limit // 2, limit)):
                cut = last.start(1)
            if cut <= 0:
                return text
            if len(self._full.encode(text[:cut], add_special_tokens=False).ids) >= self.max_length:
                return text[:cut]
            limit *= 4
        return text

    def _suffix(self, text: str) -> str:
        """_prefix's mirror for truncation on the left: the shortest whitespace-cut suffix with at least
        max_length tokens, or the text itself."""
        limit = self.max_length * _PREFIX_CHARS_PER_TOKEN
        while limit < len(text):
            start = len(text) - limit
            found = [i for i in (text.find(c, start, start + limit // 2) for c in _CUT_CHARS) if i >= 0]
            if not found and self._cjk_cuts and (first := _FIRST_CJK.search(text, start, start + limit // 2)):
                found = [first.start()]
            if not found:
                return text
            cut = min(found)
            if len(self._full.encode(text[cut:], add_special_tokens=False).ids) >= self.max_length:
                return text[cut:]
            limit *= 4
        return text

    def _plain_ascii(self, items: Sequence[Item]) -> bool:
        """Every text is ASCII without a character that sends it the full way (AsciiPath)."""
        return self._ascii is not None and all(
            part.isascii() and not self._ascii.not_plain.search(part)
            for item in items for part in ((item,) if isinstance(item, str) else item))

    def encode(self, items: Sequence[Item], truncate: bool, field: str = "inputs", offsets: bool = True,
               direction: str = "right", prompt: str = "") -> list[Encoded]:
        """encode_batch's answer, input by input."""
        return self.encode_batch(items, truncate, field, offsets, direction, prompt).split()

    def encode_batch(self, items: Sequence[Item], truncate: bool, field: str = "inputs", offsets: bool = True,
                     direction: str = "right", prompt: str = "") -> Tokenized:
        """Blocking (the tokenizer releases the GIL meanwhile). Raises InvalidInput /
        InputTooLong naming the index. offsets=False: every offset is (0, 0), and tokenising costs less.
        direction (DIRECTIONS): which end truncation cuts. prompt: put before each text (not pairs), as
        sentence-transformers does; truncation on the left cuts the text after it, never the prompt."""
        if direction not in DIRECTIONS:
            raise ValueError(f"truncation direction {direction!r} is not one of {DIRECTIONS}")
        self.check(items, field)  # the texts as sent: an empty one is refused as without a prompt
        texts = [prompt + x if isinstance(x, str) else x for x in items] if prompt else items
        plain = self._plain_ascii(texts)
        left = truncate and direction == "left"
        if left:  # offsets count from a text's start: with them, the whole text is tokenised
            batch = list(texts) if offsets else [prompt + self._suffix(x) if isinstance(x, str) else x for x in items]
            tokenizer = self._left_truncating_tokenizer(plain)
        elif truncate:
            batch = [self._prefix(x) if isinstance(x, str) else x for x in texts]
            tokenizer = self._ascii_truncating if plain else self._truncating
        else:
            for i, x in enumerate(texts):  # answer "too long" for a huge text without tokenising all of it
                if isinstance(x, str) and len(x) > self.max_length * _PREFIX_CHARS_PER_TOKEN:
                    prefix = self._prefix(x)
                    if prefix is not x:
                        raise InputTooLong(f"{item_name(field, i)} is too long: its first {len(prefix)} of {len(x)} "
                                           f"characters already make more than the {self.max_length} tokens the "
                                           f"model accepts (send truncate: true to cut it)")
            batch = list(texts)
            tokenizer = self._ascii_full if plain else self._full
        if plain and self._ascii.lowercase:  # BertNormalizer's lower-casing, in Python: a fraction of the cost
            batch = [x.lower() if isinstance(x, str) else (x[0].lower(), x[1].lower()) for x in batch]
        if plain and not offsets and self._words is not None and not left:
            return self._by_words(items, batch, truncate, field)
        try:
            encodings = _encode_all(tokenizer, batch, offsets)
        except Exception as e:  # lone surrogates ("\ud800") and the like cannot become UTF-8
            for i, item in enumerate(items):
                for part in ([item] if isinstance(item, str) else item):
                    try:
                        part.encode("utf-8")
                    except UnicodeEncodeError as ue:
                        raise InvalidInput(f"{item_name(field, i)} is not valid Unicode text ({ue.reason} at "
                                           f"character {ue.start})") from None
            raise InvalidInput(f"{field} could not be tokenised: {e}") from e
        if left and prompt:  # what the truncation cut off was the prompt
            encodings = [self._prompt_kept(x, len(prompt), plain) if isinstance(x, str) and enc.overflowing else enc
                         for x, enc in zip(batch, encodings)]
        lengths = [len(e) for e in encodings]
        self._check_lengths(items, lengths, field)
        total = sum(lengths)
        ids, type_ids = _joined([e.ids for e in encodings], total), _joined([e.type_ids for e in encodings], total)
        return Tokenized(Sequences(ids, type_ids, np.array(lengths, dtype=np.int64)), encodings)

    def _left_truncating_tokenizer(self, plain: bool) -> Tokenizer:
        if plain not in self._left_truncating:
            replace = {**self._same, **self._ascii.parts} if plain else self._same
            self._left_truncating[plain] = _load(self._text, self.max_length, truncate=True, replace=replace,
                                                 direction="left")
        return self._left_truncating[plain]

    def _prompt_kept(self, text: str, prompt_chars: int, plain: bool) -> Encoding:
        """`text`, a prompt and what follows, cut on the left to max_length tokens: the prompt's tokens, then as
        many of the text's last tokens as fit (offsets in `text`)."""
        tokenizer = self._ascii_full if plain else self._full
        room = self.max_length - self._specials[0]
        head = tokenizer.encode(text[:prompt_chars], add_special_tokens=False)
        head.truncate(room)  # a prompt the model cannot take whole is cut as truncating on the right cuts it
        tail = tokenizer.encode(text, add_special_tokens=False)
        tail.truncate(room - len(head), direction="left")
        return tokenizer.post_process(Encoding.merge([head, tail], growing_offsets=False))

    def _by_words(self, items: Sequence[Item], batch: list[Item], truncate: bool, field: str) -> Tokenized:
        encoded = [self._words.encode(x, truncate) for x in batch]
        lengths = [len(row) for row, _ in encoded]
        self._check_lengths(items, lengths, field)
        total = sum(lengths)
        type_ids = np.zeros(total, dtype=np.int64)  # segment 0 but for each pair's second text
        end = 0
        for (_, first), n in zip(encoded, lengths):
            if first < n:
                type_ids[end + first:end + n] = 1
            end += n
        ids = _joined([row for row, _ in encoded], total)
        return Tokenized(Sequences(ids, type_ids, np.array(lengths, dtype=np.int64)), None)

    def _check_lengths(self, items: Sequence[Item], lengths: list[int], field: str) -> None:
        """InputTooLong past max_length (only without truncation); InvalidInput for an input that is only
        the template's special tokens (the special-tokens mask is 1 exactly on those: counting them is
        cheaper than reading each mask). The first failing index is named."""
        for i, (item, n) in enumerate(zip(items, lengths)):
            if n > self.max_length:
                raise InputTooLong(f"{item_name(field, i)} has {n} tokens; the model accepts at most {self.max_length} "
                                   f"(send truncate: true to cut it)")
            if n == self._specials[not isinstance(item, str)]:
                raise InvalidInput(f"{item_name(field, i)} has no tokens after normalisation (only control or "
                                   f"ignored characters?)")


def _load(text: str, max_length: int, truncate: bool, replace: dict | None = None,
          direction: str = "right") -> Tokenizer:
    """A tokenizer of tokenizer.json's `text`; `replace`: pipeline parts by attribute (normalizer, ...) set
    in place of its own."""
    tokenizer = Tokenizer.from_str(text)
    tokenizer.no_padding()
    if truncate:
        tokenizer.enable_truncation(max_length, strategy="longest_first", direction=direction)
    else:
        tokenizer.no_truncation()
    for attribute, part in (replace or {}).items():
        setattr(tokenizer, attribute, part)
    return tokenizer


def _encode_all(tokenizer: Tokenizer, batch: list[Item], offsets: bool) -> list[Encoding]:
    """encode_batch spreads over a thread pool, whose hand-off costs more than one short text."""
    if not offsets:  # no offset tracking: the cheapest call, even for one text
        return tokenizer.encode_batch_fast(batch)
    if len(batch) == 1:
        item = batch[0]
        return [tokenizer.encode(item) if isinstance(item, str) else tokenizer.encode(*item)]
    return tokenizer.encode_batch(batch)


def _joined(lists: list[list[int]], total: int) -> np.ndarray:
    """The lists end to end as one int64 array: cheaper than an array per input, then concatenated."""
    return np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=total)


def describe_tokens(enc: Encoding) -> list[dict]:
    """Per token: id, token, segment (0: text_a, 1: text_b), character start/end in ITS text, special."""
    return [
        {"id": i, "token": t, "segment": s, "start": o[0], "end": o[1], "special": bool(sp)}
        for i, t, s, o, sp in zip(enc.ids, enc.tokens, enc.type_ids, enc.offsets, enc.special_tokens_mask)
    ]
