"""Faster ways to exactly the ids a BERT tokenizer.json gives: pipeline parts equivalent to its own, and
plain ASCII text tokenised word by word. Each is used only where it was checked to agree with the
tokenizers library (the tests compare them on our tokenizer and a real checkpoint's); anything else takes
the library's full way (app/tokenization.py decides)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, processors

Item = str | tuple[str, str]  # a text, or a sentence pair [CLS] A [SEP] B [SEP]

# What BertNormalizer's clean_text removes from ASCII text (tab, newline and carriage return it only turns
# into spaces, which the pre-tokenizer splits on alike), as the inside of a character class.
_ASCII_CONTROL = "\x00-\x08\x0b\x0c\x0e-\x1f\x7f"
# What BertPreTokenizer isolates in ASCII text: Rust's is_ascii_punctuation (Python's string.punctuation).
_ASCII_PUNCTUATION = r"[!-/:-@\[-`{-~]"


def equivalent_parts(config: dict) -> dict:
    """Pipeline parts, by attribute, that give exactly what tokenizer.json's `config` gives, sooner: for
    TemplateProcessing's BERT template ([CLS] A [SEP], then B [SEP] as segment 1), BertProcessing, which
    takes a tenth less of the tokenising time."""
    post = config.get("post_processor") or {}
    if post.get("type") != "TemplateProcessing" or len(post.get("single") or ()) != 3:
        return {}
    cls, sep = (post["single"][i].get("SpecialToken", {}).get("id") for i in (0, 2))

    def piece(kind: str, name: str, segment: int) -> dict:
        return {kind: {"id": name, "type_id": segment}}

    single = [piece("SpecialToken", cls, 0), piece("Sequence", "A", 0), piece("SpecialToken", sep, 0)]
    pair = [*single, piece("Sequence", "B", 1), piece("SpecialToken", sep, 1)]
    ends = [(post.get("special_tokens") or {}).get(name) or {} for name in (sep, cls)]
    if (post["single"] != single or post.get("pair") != pair
            or any(len(e.get("ids", ())) != 1 or len(e.get("tokens", ())) != 1 for e in ends)):
        return {}
    return {"post_processor": processors.BertProcessing(*((e["tokens"][0], e["ids"][0]) for e in ends))}


@dataclass(frozen=True)
class AsciiPath:
    """How plain ASCII text skips the Unicode work of a BERT tokenizer. On ASCII text without control
    characters, BertNormalizer only lower-cases (accents and Chinese characters are not ASCII; clean_text
    only turns tab, newline and carriage return into spaces), which str.lower does first at a fraction of
    the cost; BertPreTokenizer splits at whitespace and isolates ASCII punctuation, looking every other
    character up in Unicode's punctuation tables (a tenth of the tokenising time), which the parts here
    do without. Added tokens are matched in the text as sent, so lower-casing it first could make or
    break a match, and AsciiWords does not look for them: a text holding the first character of one
    (either case where the tokenizer lower-cases) goes the full way."""
    parts: dict  # pipeline parts by attribute, in place of tokenizer.json's
    lowercase: bool  # texts are lower-cased before they are tokenised
    not_plain: re.Pattern  # a character that sends an ASCII text the full way


def ascii_path(config: dict) -> AsciiPath | None:
    """For tokenizer.json's `config`. None for a normalizer other than BertNormalizer, or when an added
    token is matched after normalisation (where the two ways could differ)."""
    bert = config.get("normalizer") or {}
    added = config.get("added_tokens", ())
    if bert.get("type") != "BertNormalizer" or any(t.get("normalized") for t in added):
        return None
    parts: dict = {"normalizer": normalizers.Sequence([])}
    if (config.get("pre_tokenizer") or {}).get("type") == "BertPreTokenizer":
        parts["pre_tokenizer"] = pre_tokenizers.Sequence([
            pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex(_ASCII_PUNCTUATION), "isolated")])
    lowercase = bool(bert.get("lowercase"))
    marks = {c for t in added for c in (t["content"][:1], t["content"][:1].upper() if lowercase else "")}
    not_plain = re.compile(f"[{_ASCII_CONTROL}{''.join(re.escape(c) for c in sorted(marks) if c)}]")
    return AsciiPath(parts, lowercase, not_plain)


# BertPreTokenizer's split of plain ASCII text (AsciiPath's WhitespaceSplit, then punctuation isolated):
# runs of characters that are neither whitespace nor ASCII punctuation, and each punctuation mark alone.
_WORDS = re.compile(rf"[^\s{_ASCII_PUNCTUATION[1:-1]}]+|{_ASCII_PUNCTUATION}")
_WORDS_REMEMBERED = 100_000  # distinct words kept (about 16 MB); past it the memory starts again empty


class AsciiWords:
    """Plain ASCII texts and pairs (already lower-cased where the tokenizer lower-cases) -> `[CLS] a [SEP]`
    or `[CLS] a [SEP] b [SEP]` ids, word by word: each word's WordPiece ids come from the tokenizer's own
    model, once, and are remembered. WordPiece splits every word on its own, so a text's ids are its words'
    ids end to end, and truncation is the tokenizer's (longest first); a short text costs a few µs instead
    of the tokenizer's tens. Offsets are not tracked. Safe from several threads: a dict's get and set are
    atomic under the GIL."""

    def __init__(self, model: models.WordPiece, cls: int, sep: int, max_length: int):
        self._model, self._cls, self._sep, self._max_length = model, cls, sep, max_length
        self._remembered: dict[str, list[int]] = {}

    @classmethod
    def of(cls, tokenizer: Tokenizer, ascii_path: AsciiPath, max_length: int) -> AsciiWords | None:
        """For the ASCII path's tokenizer, or None where its ids could differ from this way's: a model
        other than WordPiece, templates other than BERT's, a pre-tokenizer other than BertPreTokenizer's,
        or any disagreement on a probe text or pair."""
        if not isinstance(tokenizer.model, models.WordPiece) or "pre_tokenizer" not in ascii_path.parts:
            return None
        if (tokenizer.num_special_tokens_to_add(False), tokenizer.num_special_tokens_to_add(True)) != (2, 3):
            return None
        ends = tokenizer.encode("a").ids
        words = cls(tokenizer.model, ends[0], ends[-1], max_length)
        text = "the quick, brown fox's 2nd jump-over (at 9:30pm) isn't x" + "y" * 120 + " ok?!"
        for item in (text, (text, "and a second one.")):
            probe = tokenizer.encode(item) if isinstance(item, str) else tokenizer.encode(*item)
            ids, first = words.encode(item, truncate=False)
            if ids != probe.ids or probe.type_ids != [0] * first + [1] * (len(ids) - first):
                return None
        return words

    def encode(self, item: Item, truncate: bool) -> tuple[list[int], int]:
        """(ids, how many of them are segment 0)."""
        if isinstance(item, str):
            pieces = self._pieces(item)
            if truncate:
                del pieces[self._max_length - 2:]
            return [self._cls, *pieces, self._sep], len(pieces) + 2
        first, second = self._pieces(item[0]), self._pieces(item[1])
        if truncate:
            n1, n2 = longest_first(len(first), len(second), self._max_length - 3)
            del first[n1:], second[n2:]
        return [self._cls, *first, self._sep, *second, self._sep], len(first) + 2

    def _pieces(self, text: str) -> list[int]:
        ids: list[int] = []
        remembered = self._remembered
        for word in _WORDS.findall(text):
            pieces = remembered.get(word)
            if pieces is None:
                pieces = [t.id for t in self._model.tokenize(word)]
                if len(remembered) >= _WORDS_REMEMBERED:
                    remembered.clear()
                remembered[word] = pieces
            ids += pieces
        return ids


def longest_first(n1: int, n2: int, limit: int) -> tuple[int, int]:
    """How many tokens of each of a pair the tokenizers library's `longest_first` truncation keeps, when
    `limit` tokens are left for both: the shorter keeps all it can, the longer the rest, and when both are
    past half of it, each about half."""
    if n1 + n2 <= limit:
        return n1, n2
    short, long_ = min(n1, n2), max(n1, n2)
    long_ = short if short > limit else max(short, limit - short)
    if short + long_ > limit:
        short = limit // 2
        long_ = short + limit % 2
    return (short, long_) if n1 <= n2 else (long_, short)
