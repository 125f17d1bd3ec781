"""Reads a text corpus into documents (lists of sentences): .txt files in the original BERT format
(one sentence or paragraph per line, documents separated by blank lines) and .jsonl files (a `text`
field per document, or another named), either also gzip-compressed (.txt.gz, .jsonl.gz), named as files,
folders or globs.

Everything streams: a file is never read whole, and an over-long line is cut into bounded pieces.
"""
from __future__ import annotations

import codecs
import glob
import gzip
import json
import logging
import os
import re
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

CORPUS_SUFFIXES = (".txt", ".jsonl")  # each also read gzip-compressed, with .gz after it
# Longer "sentences" (tables, minified data, a 10 MB line with no full stop) are cut into pieces of at
# most this many characters, at whitespace where there is some: pairs are built from whole sentences.
MAX_SENTENCE_CHARS = 1000
# A line is read in pieces of this many bytes so a file with no newline never sits in memory whole.
_READ_BYTES = 1 << 20
# A file with a NUL byte in its first this many bytes is not text (git's and grep's test for a binary file).
_SNIFF_BYTES = 8192
_GZIP_MAGIC = b"\x1f\x8b"
# A document longer than this many sentences (a book, a 200 MB line) is handed on in parts of this size,
# so memory follows the part, not the document; next-sentence pairs are lost only across each cut.
MAX_DOCUMENT_SENTENCES = 10_000

Document = list[str]
_SURROGATE = re.compile("[\ud800-\udfff]")  # in a str only from JSON's \u escapes, alone


class CorpusError(ValueError):
    """A corpus that cannot be used (missing, empty, too few documents); the message says what to do."""


@dataclass
class CorpusStats:
    """Counted while reading; the reader adds to it, so one object can follow several passes."""

    files: int = 0
    bytes_read: int = 0  # of the files as they are stored (compressed, for a .gz): how far a pass has got
    documents: int = 0
    sentences: int = 0
    words: int = 0
    characters: int = 0
    lines_with_bad_bytes: int = 0
    bad_jsonl_lines: int = 0
    files_with_bad_bytes: list[str] = field(default_factory=list)


# --- sentences ---------------------------------------------------------------------------------

# Candidate boundary: . ! ? (maybe closing quotes/brackets), whitespace, then something that starts a
# sentence (capital, digit, quote or opening bracket). `word` is the word the stop ends. Matches start
# only at a word or a run of stops, and never backtrack, so a 10 MB line of anything is read in linear time.
_BOUNDARY = re.compile(r"""(?<!\w)(?P<word>\w*)(?<![.!?])(?P<stop>[.!?]++)(?P<close>["')\]’”]*+)\s++"""
                       r"""(?=["'(\[‘“]?[A-Z0-9])""")
# Words whose full stop ends no sentence ("e.g." and "i.e." end in a one-letter word, like initials).
_ABBREVIATIONS = frozenset("""
    etc vs cf al dr mr mrs ms prof sr jr st no nos fig figs eq eqs approx ca resp incl
    sec ch vol pp jan feb mar apr jun jul aug sep sept oct nov dec mt inc ltd co corp dept est
""".split())


def _is_abbreviation(word: str) -> bool:
    return len(word) == 1 and word.isalpha() or word.lower() in _ABBREVIATIONS


def _cut_long(sentence: str) -> Iterator[str]:
    start, n = 0, len(sentence)
    while n - start > MAX_SENTENCE_CHARS:
        cut = sentence.rfind(" ", start + MAX_SENTENCE_CHARS // 2, start + MAX_SENTENCE_CHARS)
        cut = start + MAX_SENTENCE_CHARS if cut < 0 else cut
        head = sentence[start:cut].strip()
        if head:
            yield head
        start = cut
    tail = sentence[start:].strip()
    if tail:
        yield tail


def split_sentences(text: str) -> list[str]:
    """Sentences of one line or paragraph, none longer than MAX_SENTENCE_CHARS."""
    out: list[str] = []
    start = 0
    for m in _BOUNDARY.finditer(text):
        if m["stop"] == "." and not m["close"] and _is_abbreviation(m["word"]):
            continue
        end = m.end("close")
        piece = text[start:end].strip()
        if piece:
            out.extend(_cut_long(piece))
        start = m.end()
    piece = text[start:].strip()
    if piece:
        out.extend(_cut_long(piece))
    return out


# --- files -------------------------------------------------------------------------------------

def resolve_corpus_files(paths: Iterable[str | Path]) -> list[Path]:
    """The .txt/.jsonl files named by `paths` (files, folders searched recursively, globs), each once,
    in a deterministic order (as given; sorted within a folder or glob)."""
    paths = [str(p) for p in paths]
    if not paths:
        raise CorpusError("no corpus given; pass --corpus with .txt/.jsonl files, folders or globs")
    files: list[Path] = []
    for entry in paths:
        p = Path(entry).expanduser()
        if p.is_file():
            found = [p]
        elif p.is_dir():
            # read as the glob FOLDER/** (hidden files skipped, symbolic links followed), so that a folder
            # and a glob of it name the same files in the same order
            found = _glob_files(os.path.join(glob.escape(str(p)), "**"), entry)
        elif glob.has_magic(entry):
            found = _glob_files(str(p), entry)
        else:
            raise CorpusError(f"corpus path {entry} does not exist; check the path or the glob")
        if p.is_file() and corpus_kind(p) is None:
            raise CorpusError(f"corpus file {entry} is neither .txt nor .jsonl (nor either with .gz); convert it "
                              f"or leave it out")
        files.extend(found)
    unique = list(dict.fromkeys(f.resolve() for f in files))
    if not unique:
        raise CorpusError(f"no .txt or .jsonl files (or .txt.gz, .jsonl.gz) found in {', '.join(paths)}; "
                          f"point --corpus at files with one of those suffixes")
    return unique


def corpus_kind(path: Path) -> str | None:
    """".txt" or ".jsonl" for a corpus file, compressed (NAME.txt.gz) or not; None for any other file."""
    suffixes = [s.lower() for s in path.suffixes[-2:]]
    if suffixes[-1:] == [".gz"]:
        suffixes.pop()
    return suffixes[-1] if suffixes and suffixes[-1] in CORPUS_SUFFIXES else None


def _glob_files(pattern: str, entry: str) -> list[Path]:
    """The corpus files `pattern` matches, sorted; one warning for corpus files compressed other than with
    gzip, which are left out (a folder of .txt.zst files would otherwise train on the rest without a word)."""
    named = (Path(f) for f in _expand(pattern))
    matched = [f for f in named if (corpus_kind(f) or _compressed_otherwise(f)) and f.is_file()]
    if other := [f for f in matched if _compressed_otherwise(f)]:
        log.warning("%s: left out %d corpus file%s compressed other than with gzip (e.g. %s); decompress them, "
                    "or recompress them with gzip (.gz)", entry, len(other), "s" * (len(other) > 1), other[0].name)
    return sorted(f for f in matched if corpus_kind(f))


_OTHER_COMPRESSIONS = (".bz2", ".xz", ".zst", ".lz4", ".zip", ".7z", ".br")


def _compressed_otherwise(path: Path) -> bool:
    """NAME.txt.bz2 or NAME.jsonl.zst: a corpus file in a compression this reader does not take."""
    suffixes = [s.lower() for s in path.suffixes[-2:]]
    return len(suffixes) == 2 and suffixes[0] in CORPUS_SUFFIXES and suffixes[1] in _OTHER_COMPRESSIONS


def _expand(pattern: str) -> Iterator[str]:
    """glob.glob(pattern, recursive=True), except that `**` enters no folder it is already inside: glob's
    own walk goes round a link to a folder above until the path is too long, and with two such links
    (`latest -> .`, `up -> ..`) that is 2^40 paths."""
    parts = Path(pattern).parts
    if "**" not in parts:
        yield from glob.glob(pattern)
        return
    i = parts.index("**")
    head, rest = os.path.join(*parts[:i]) if i else ".", parts[i + 1:]
    for base in glob.glob(head) if glob.has_magic(head) else [head]:
        for folder in _folders_under(base, frozenset({os.path.realpath(base)})) if os.path.isdir(base) else ():
            if rest:
                yield from _expand(os.path.join(glob.escape(folder), *rest))
            else:
                yield from (os.path.join(folder, e.name) for e in _entries(folder))


def _folders_under(folder: str, inside: frozenset[str]) -> Iterator[str]:
    """`folder` and every folder below it, as `**` walks them (hidden ones left out, links followed), but
    not into a folder of `inside`, the real folders on the way down."""
    yield folder
    for e in _entries(folder):
        if e.is_dir() and (real := os.path.realpath(e.path)) not in inside:
            yield from _folders_under(os.path.join(folder, e.name), inside | {real})


def _entries(folder: str) -> list[os.DirEntry]:
    try:
        with os.scandir(folder) as it:
            return sorted((e for e in it if not e.name.startswith(".")), key=lambda e: e.name)
    except OSError:  # unreadable: left out, as glob leaves it
        return []


def _read_pieces(path: Path, stats: CorpusStats) -> Iterator[tuple[str, bool, bool]]:
    """(text, ends_a_line, had_bad_bytes) pieces of at most _READ_BYTES bytes of a UTF-8 file, each ending at
    its \\n if it has one (kept, as is a \\r before it), decompressed
    as it is read where it ends in .gz, counting the file's bytes read into `stats`. Bytes that are not
    UTF-8 become U+FFFD; a character cut at a piece's end is completed by the next."""
    try:
        yield from _decoded_pieces(path, stats, path.suffix.lower() == ".gz")
    except (OSError, EOFError, zlib.error) as e:  # a truncated or damaged .gz, a file gone or unreadable
        raise CorpusError(f"cannot read corpus file {path}: {getattr(e, 'strerror', None) or e}") from e


def _decoded_pieces(path: Path, stats: CorpusStats, gzipped: bool) -> Iterator[tuple[str, bool, bool]]:
    strict, lenient = codecs.getincrementaldecoder("utf-8")(), codecs.getincrementaldecoder("utf-8")("replace")
    first, before = True, stats.bytes_read
    with (gzip.open if gzipped else open)(path, "rb") as f:
        stored = f.fileobj if gzipped else f
        head = f.peek(_SNIFF_BYTES)[:_SNIFF_BYTES]
        while True:
            raw = f.readline(_READ_BYTES)
            stats.bytes_read = before + stored.tell()
            ends = raw.endswith(b"\n") or len(raw) < _READ_BYTES  # short and no newline: the file's end
            try:
                text, bad = strict.decode(raw, final=ends), False
            except UnicodeDecodeError:
                strict.reset()
                text, bad = lenient.decode(raw, final=ends), True
                lenient.reset()
            if first:
                if raw.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE, codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
                    # every other byte NUL: read as UTF-8 it would be one document of garbage, refused as "too few"
                    width = 32 if raw.startswith((codecs.BOM_UTF32_LE, codecs.BOM_UTF32_BE)) else 16
                    raise CorpusError(f"{path} is UTF-{width} text (it starts with a UTF-{width} byte-order mark); "
                                      f"convert it to UTF-8, e.g. iconv -f UTF-{width} -t UTF-8")
                # no text file holds NUL or starts with gzip's magic; read as text, such a file trained as garbage
                if b"\0" in head or head.startswith(_GZIP_MAGIC) and not gzipped:
                    raise CorpusError(_not_text(path, head, gzipped))
                text, first = text.removeprefix("\ufeff"), False
            if not raw:
                return
            yield text, ends, bad


def _not_text(path: Path, head: bytes, gzipped: bool) -> str:
    if head.startswith(_GZIP_MAGIC) and not gzipped:
        return f"{path} is gzip-compressed; name it {path.name}.gz to have it decompressed as it is read"
    return (f"{path} is not UTF-8 text: it holds NUL bytes in its first {_SNIFF_BYTES // 1024} KB, as a binary file or "
            f"UTF-16/UTF-32 text without a byte-order mark does; convert it to UTF-8 (iconv) or leave it out")


def _txt_lines(pieces: Iterable[tuple[str, bool, bool]]) -> Iterator[tuple[str, bool, bool]]:
    r"""The pieces of _read_pieces, without their line ends, cut at every line end that str.splitlines knows
    (as a .jsonl document's text is), not only at \n: a file saved with \r alone (classic Mac OS, some
    exports) would be one document, and the tokenizer deletes \v, \f, NEL and \x1c-\x1e (control
    characters), gluing the words either side of them into one."""
    after_cr = False  # the last piece ended in \r, whose \n may start the next: one line end, not two
    for text, ends, bad in pieces:
        if after_cr and text.startswith("\n"):
            text = text[1:]
            if not text:
                after_cr = False
                continue
        after_cr = text.endswith("\r")
        lines = text.splitlines(keepends=True) or [""]
        for i, line in enumerate(lines):
            body = line.splitlines()[0] if line else ""
            yield body, len(body) < len(line) or (ends and i == len(lines) - 1), bad and i == 0


def _txt_documents(path: Path, stats: CorpusStats) -> Iterator[Document]:
    doc: Document = []
    carry = ""  # the unfinished last sentence of a line that is still being read
    bad_lines = 0
    for piece, line_ends, bad in _txt_lines(_read_pieces(path, stats)):
        bad_lines += bad
        if line_ends and not carry and not piece.strip():
            if doc:
                yield doc
            doc = []
            continue
        text = carry + piece
        sentences = split_sentences(text)
        carry = ""
        if not line_ends and sentences:  # the last sentence may go on in the next piece; the space that
            carry = sentences.pop() + text[len(text.rstrip()):]  # ends the piece keeps two words apart
        doc.extend(sentences)
        while len(doc) >= MAX_DOCUMENT_SENTENCES:
            yield doc[:MAX_DOCUMENT_SENTENCES]
            doc = doc[MAX_DOCUMENT_SENTENCES:]
    if carry:
        doc.append(carry)
    if doc:
        yield doc
    _note_bad_bytes(path, bad_lines, stats)


def _text_document(text: str) -> Document:
    return [s for line in text.splitlines() for s in split_sentences(line)]


def _jsonl_documents(path: Path, stats: CorpusStats, text_field: str) -> Iterator[Document]:
    bad_lines = bad_json = 0
    line, line_bad = [], False
    for piece, line_ends, bad in _read_pieces(path, stats):
        line.append(piece)
        line_bad |= bad
        if not line_ends:
            continue
        text, had_bad, line, line_bad = "".join(line), line_bad, [], False
        bad_lines += had_bad
        if not text.strip():
            continue
        try:
            text = json.loads(text)[text_field]
            if not isinstance(text, str):
                raise TypeError(f"{text_field} is not a string")
        except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: JSON nested past Python's depth
            bad_json += 1
            continue
        if not text.isascii() and _SURROGATE.search(text):
            # a \ud83d escape with no pair (an emoji cut in two, as JavaScript cuts strings): not UTF-8,
            # and the tokenizer's training stopped at it with a traceback; replaced, as a bad byte is
            text, bad_lines = _SURROGATE.sub("\ufffd", text), bad_lines + (not had_bad)
        doc = _text_document(text)
        for start in range(0, len(doc), MAX_DOCUMENT_SENTENCES):
            yield doc[start:start + MAX_DOCUMENT_SENTENCES]
    stats.bad_jsonl_lines += bad_json
    _note_bad_bytes(path, bad_lines, stats)


def _note_bad_bytes(path: Path, bad_lines: int, stats: CorpusStats) -> None:
    if bad_lines:
        stats.lines_with_bad_bytes += bad_lines
        stats.files_with_bad_bytes.append(str(path))


def read_documents(files: Iterable[Path], stats: CorpusStats | None = None, *, warn: bool = True,
                   text_field: str = "text") -> Iterator[Document]:
    """Every non-empty document of `files` (a .jsonl line's in its `text_field`), in order, counting into
    `stats`, with a warning for each file that had lines skipped or bytes replaced; `warn` off for a second
    pass over the same files."""
    stats = stats if stats is not None else CorpusStats()
    for path in files:
        stats.files += 1
        bad_json, bad_bytes = stats.bad_jsonl_lines, stats.lines_with_bad_bytes
        documents = (_jsonl_documents(path, stats, text_field) if corpus_kind(path) == ".jsonl"
                     else _txt_documents(path, stats))
        for doc in documents:
            stats.documents += 1
            stats.sentences += len(doc)
            stats.words += sum(len(s.split()) for s in doc)
            stats.characters += sum(len(s) for s in doc)
            yield doc
        if warn and stats.bad_jsonl_lines > bad_json:
            log.warning("%s: skipped %d lines that are not JSON objects with a string `%s` field", path,
                        stats.bad_jsonl_lines - bad_json, text_field)
        if warn and stats.lines_with_bad_bytes > bad_bytes:
            # U+FFFD is dropped by the tokenizer: a cp1252 file's "café" trains as "caf"; say how to convert it
            log.warning("%s: %d lines had bytes that are not UTF-8 (replaced by U+FFFD, which the tokenizer drops); "
                        "if it is in another encoding, convert it to UTF-8, e.g. iconv -f CP1252 -t UTF-8 for "
                        "Windows text", path, stats.lines_with_bad_bytes - bad_bytes)
