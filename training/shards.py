"""Token shards: a corpus tokenised once into flat arrays that training only memory-maps.

A shard folder holds
    tokens-00000.bin ...  token ids (uint16, or uint32 past 65,535 ids); a document never spans two files
    sentences.bin         int64 [sentences + 1]: where each sentence starts in the global token stream
    documents.bin         int64 [documents + 1]: the first sentence of each document
    sentence_digests.bin  8 bytes per sentence: a digest of its words (the held-out split compares them)
    token_counts.npy      int64 [vocab size]: how often each id occurs
    shards.json           dtype, files and totals
Documents stream through: memory stays bounded by one tokenisation batch, whatever the corpus size.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from training.corpus import Document

SHARD_TOKENS = 1 << 26          # 64 Mi tokens (128 MiB of uint16) per token file
_BATCH_SENTENCES = 16384         # sentences per encode_batch call
_META = "shards.json"


def _token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class _Writer:
    def __init__(self, out_dir: Path, vocab_size: int, shard_tokens: int):
        self.out_dir, self.shard_tokens, self.vocab_size = out_dir, shard_tokens, vocab_size
        self.dtype = _token_dtype(vocab_size)
        self.sentences = open(out_dir / "sentences.bin", "wb")
        self.documents = open(out_dir / "documents.bin", "wb")
        self.digests = open(out_dir / "sentence_digests.bin", "wb")
        self.token_file = None
        self.shards: list[dict] = []
        self.n_tokens = self.n_sentences = self.n_documents = 0
        self.counts = np.zeros(vocab_size, dtype=np.int64)

    def add(self, lengths: list[int], ids: np.ndarray, digests: bytes) -> None:
        """One document: its sentences' token counts, all its ids and its sentences' digests."""
        if self.token_file is None or self.shards[-1]["end"] - self.shards[-1]["start"] >= self.shard_tokens:
            self._next_shard()
        starts = self.n_tokens + np.concatenate([[0], np.cumsum(lengths[:-1], dtype=np.int64)])
        self.sentences.write(starts.astype(np.int64).tobytes())
        self.documents.write(np.int64(self.n_sentences).tobytes())
        self.token_file.write(ids.astype(self.dtype, copy=False).tobytes())
        self.digests.write(digests)
        self.counts += np.bincount(ids, minlength=self.vocab_size)[: self.vocab_size]
        self.n_tokens += len(ids)
        self.n_sentences += len(lengths)
        self.n_documents += 1
        self.shards[-1]["end"] = self.n_tokens

    def _next_shard(self) -> None:
        if self.token_file is not None:
            self.token_file.close()
        name = f"tokens-{len(self.shards):05d}.bin"
        self.token_file = open(self.out_dir / name, "wb")
        self.shards.append({"file": name, "start": self.n_tokens, "end": self.n_tokens})

    def close(self) -> dict:
        self.sentences.write(np.int64(self.n_tokens).tobytes())
        self.documents.write(np.int64(self.n_sentences).tobytes())
        for f in (self.sentences, self.documents, self.digests, self.token_file):
            if f is not None:
                f.close()
        np.save(self.out_dir / "token_counts.npy", self.counts)
        meta = {"dtype": self.dtype.name, "shards": self.shards, "tokens": self.n_tokens,
                "sentences": self.n_sentences, "documents": self.n_documents, "vocab_size": self.vocab_size}
        (self.out_dir / _META).write_text(json.dumps(meta, indent=2) + "\n")
        return meta


def _words(tokenizer: Tokenizer):
    """A sentence's words as the tokenizer reads them (its lower-casing and accents applied, whitespace
    collapsed): what a sentence's digest is of. Not its ids, which a vocabulary that reads most words as [UNK]
    would make the same for most sentences."""
    normalize = tokenizer.normalizer.normalize_str if tokenizer.normalizer is not None else str
    return lambda sentence: " ".join(normalize(sentence).split())


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=8).digest()


def _encoded_documents(documents: Iterable[Document], tokenizer: Tokenizer, max_sentences: int):
    """(token counts of its sentences, all its ids, its sentences' digests) per document, sentences with no
    tokens left out and documents with none skipped. Sentences are encoded `max_sentences` at a time, across small documents
    and within a large one, and kept as compact arrays: memory follows the batch, not the document (a
    200 MB one-line document is 200k sentences, whose Encoding objects alone took 40 times its size)."""
    chunk: list[str] = []
    ends: list[bool] = []  # whether chunk[i] is its document's last sentence
    lengths: list[int] = []  # the current document's
    parts: list[np.ndarray] = []
    digests: list[bytes] = []
    words = _words(tokenizer)

    def encode():
        nonlocal lengths, parts, digests
        for encoding, sentence, last in zip(tokenizer.encode_batch(chunk, add_special_tokens=False), chunk, ends):
            if encoding.ids:
                lengths.append(len(encoding.ids))
                parts.append(np.array(encoding.ids, dtype=np.int32))
                digests.append(_digest(words(sentence)))
            if last:
                if lengths:
                    yield lengths, np.concatenate(parts), b"".join(digests)
                lengths, parts, digests = [], [], []
        chunk.clear()
        ends.clear()

    for doc in documents:
        for i, sentence in enumerate(doc):
            chunk.append(sentence)
            ends.append(i == len(doc) - 1)
            if len(chunk) >= max_sentences:
                yield from encode()
    if chunk:
        yield from encode()


def write_shards(documents: Iterable[Document], tokenizer: Tokenizer, out_dir: Path, *,
                 shard_tokens: int = SHARD_TOKENS) -> dict:
    """Tokenise `documents` (no special tokens added) into a shard folder; returns its totals.
    Sentences with no tokens and documents with no sentences left are dropped."""
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = _Writer(out_dir, tokenizer.get_vocab_size(), shard_tokens)
    # "[SEP]" written in the text (docstrings about BERT have it) must stay text, not become the special id.
    tokenizer.encode_special_tokens = True
    try:
        for lengths, ids, digests in _encoded_documents(documents, tokenizer, _BATCH_SENTENCES):
            writer.add(lengths, ids, digests)
    finally:
        tokenizer.encode_special_tokens = False
    return writer.close()


def _mapped(path: Path, dtype: np.dtype) -> np.ndarray:
    if path.stat().st_size == 0:  # no sentences: nothing to map (mmap refuses an empty file)
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r").view(np.ndarray)


class TokenShards:
    """A shard folder, memory-mapped. Token positions are global (across the token files)."""

    def __init__(self, folder: Path | str):
        self.folder = Path(folder)
        meta = json.loads((self.folder / _META).read_text())
        self.meta = meta
        self.n_tokens, self.n_sentences, self.n_documents = meta["tokens"], meta["sentences"], meta["documents"]
        self.vocab_size = meta["vocab_size"]
        dtype = np.dtype(meta["dtype"])
        # Plain ndarray views of the maps: numpy's memmap subclass costs microseconds per slice.
        self._files = [_mapped(self.folder / s["file"], dtype) for s in meta["shards"]]
        self._file_starts = np.array([s["start"] for s in meta["shards"]], dtype=np.int64)
        self.sentence_starts = _mapped(self.folder / "sentences.bin", np.dtype(np.int64))
        self.document_starts = _mapped(self.folder / "documents.bin", np.dtype(np.int64))
        self.sentence_digests = _mapped(self.folder / "sentence_digests.bin", np.dtype(np.uint64))  # [sentences]

    def tokens(self, start: int, end: int) -> np.ndarray:
        """Ids at global positions [start, end), which must lie within one document."""
        if len(self._files) == 1:
            return self._files[0][start:end]
        f = int(np.searchsorted(self._file_starts, start, side="right")) - 1
        base = int(self._file_starts[f])
        return self._files[f][start - base: end - base]

    def token_counts(self, document_ids: np.ndarray | None = None) -> np.ndarray:
        """Occurrences of each id over all documents, or over `document_ids` (sorted)."""
        total = np.load(self.folder / "token_counts.npy")
        if document_ids is None or len(document_ids) == self.n_documents:
            return total
        # Count the smaller side: a held-out set directly, a training set as all minus the held-out rest.
        others = np.setdiff1d(np.arange(self.n_documents), document_ids, assume_unique=True)
        smaller = document_ids if len(document_ids) <= len(others) else others
        counts = np.zeros_like(total)
        for d in smaller:
            s0, s1 = self.document_starts[d], self.document_starts[d + 1]
            ids = self.tokens(int(self.sentence_starts[s0]), int(self.sentence_starts[s1]))
            counts += np.bincount(ids, minlength=len(total))[: len(total)]
        return counts if smaller is document_ids else total - counts
