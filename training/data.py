"""The pre-training data the trainer sees: `prepare_data(DataConfig)` builds (or finds in the cache)
the tokenizer and the token shards, and hands out MLM + NSP batches that are a pure function of
(seed, epoch, batch index) — so every rank and every resumed run agrees on them.

corpus files (or the docstring corpus) → WordPiece → shards (cached under a hash of what made them)
→ held-out documents, less the sentences that training documents also hold (unseen_spans)
→ per epoch: sentence pairs (examples.py) → shuffled → per example: masking (masking.py) → padded batch
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import shutil
import sys
import time
from collections.abc import Generator, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

import numpy as np
import torch
from tokenizers import Tokenizer
from tqdm import tqdm

from training.corpus import CorpusError, CorpusStats, Document, read_documents, resolve_corpus_files
from training.docstring_corpus import docstring_corpus, docstring_corpus_path
from training.examples import IS_NEXT, NSP_LABEL, PAIR_COLUMNS, Spans, balance_labels, draw_pairs, finish
from training.masking import Masker
from training.shards import TokenShards, write_shards
from training.wordpiece import CLS, MASK, PAD, SEP, UNK, load_tokenizer_from_folder, save_tokenizer, \
    tokenizer_from_vocab, train_wordpiece
from training.writes import check_writable, remove_stale_siblings, write_failed

log = logging.getLogger(__name__)

_FORMAT = 4          # bump when the shard layout, the text read, the tokenisation or the tokenizer files saved change
_SCAN_SENTENCES = 1 << 22  # sentence digests compared with the held-out ones at a time (32 MiB)
_MIN_FREQUENCY = 2   # of a WordPiece we train
_DONE = "DONE"
_WAIT_LOG_S = 60.0
_PROGRESS_LINE_S = 60.0  # between the lines of a pass over the corpus where no bar is drawn


@dataclass(frozen=True)
class DataConfig:
    corpus: tuple[str, ...] = ()          # empty -> embedded default corpus (docstrings)
    vocab_size: int = 8192                # vocab to train when no vocab_file / tokenizer_dir
    vocab_file: str | None = None         # use an existing vocab.txt instead of training one
    tokenizer_dir: str | None = None      # use a model folder's tokenizer as it is (its own lower-casing)
    lowercase: bool = True                # of a trained tokenizer or a vocab_file
    max_seq_len: int = 128
    short_seq_prob: float = 0.1
    masked_lm_prob: float = 0.15
    max_predictions_per_seq: int = 20
    whole_word_masking: bool = False
    heldout_fraction: float = 0.01
    text_field: str = "text"              # of a .jsonl document
    cache_dir: str = ".cache/bertserve"
    balance_nsp: bool = True              # drop surplus pairs so that exactly half are IsNext

    def __post_init__(self) -> None:
        if isinstance(self.corpus, (str, os.PathLike)):  # one path given bare
            object.__setattr__(self, "corpus", (str(self.corpus),))
        else:
            object.__setattr__(self, "corpus", tuple(str(p) for p in self.corpus))
        # named as training.pretrain's flags, which set these fields one to one
        if self.max_seq_len < 8:
            raise ValueError(f"--max-seq-len {self.max_seq_len} is too short for [CLS] A [SEP] B [SEP]; use >= 8")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise ValueError(f"short_seq_prob {self.short_seq_prob} is not a probability")
        if not 0.0 < self.masked_lm_prob < 1.0:
            raise ValueError(f"--masked-lm-prob {self.masked_lm_prob} must lie strictly between 0 and 1")
        if self.max_predictions_per_seq < 1:
            raise ValueError(f"--max-predictions must be at least 1, got {self.max_predictions_per_seq}")
        if not 0.0 <= self.heldout_fraction <= 0.5:
            raise ValueError(f"--heldout-fraction {self.heldout_fraction} must lie in [0, 0.5]")
        if self.text_field != "text" and not self.corpus:
            raise ValueError(f"--text-field {self.text_field} names a field of your .jsonl corpus; pass --corpus too")
        if self.vocab_file is not None and self.tokenizer_dir is not None:
            raise ValueError("vocab_file and tokenizer_dir both name a vocabulary; pass one")
        if self.vocab_file is None and self.tokenizer_dir is None and self.vocab_size < 105:
            raise ValueError(f"--vocab-size {self.vocab_size} is too small; use at least 105")


def _seed(*parts: object) -> int:
    """A 64-bit seed from any parts, the same on every machine and Python (unlike hash())."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


class _PairsAhead:
    """One epoch's pairs, drawn a step at a time between the batches of the epoch before (in the worker's
    own thread: a thread beside it would take turns at the GIL with the batches just when they are due)."""

    def __init__(self, epoch: int, drawing: Generator[None, None, np.ndarray]):
        self.epoch, self._drawing = epoch, drawing
        self._pairs: np.ndarray | None = None

    def step(self) -> None:
        if self._pairs is None:
            try:
                next(self._drawing)
            except StopIteration as done:
                self._pairs = done.value

    def result(self) -> np.ndarray:
        if self._pairs is None:
            self._pairs = finish(self._drawing)
        return self._pairs


class PretrainingDataset:
    """The MLM + NSP examples of a set of documents. Pairs are drawn anew each epoch, masks anew for
    each example; nothing but the pairs of the current epoch and, once asked for, of the next (six
    integers each) is held in memory. Pairs come from the documents whole or, given `spans`, from those
    parts of them (the held-out split's: its sentences that no training document holds)."""

    def __init__(self, shards: TokenShards, document_ids: np.ndarray, tokenizer: Tokenizer, *,
                 max_seq_len: int, short_seq_prob: float, masker: Masker, balance_nsp: bool = True,
                 pairing_seed: int = 0, spans: Spans | None = None):
        self.shards = shards
        self.document_ids = np.asarray(document_ids, dtype=np.int64)
        self.spans = spans
        self._sources = len(self.document_ids) if spans is None else len(spans.first)  # what pairs are drawn from
        self.max_seq_len, self.short_seq_prob = max_seq_len, short_seq_prob
        self.masker = masker
        self.balance_nsp = balance_nsp
        # Pairs depend on (pairing_seed, epoch) only, so that num_examples(epoch) needs no seed; the
        # run's seed orders the examples and draws the masks.
        self.pairing_seed = pairing_seed
        self.cls_id, self.sep_id, self.pad_id = (tokenizer.token_to_id(t) for t in (CLS, SEP, PAD))
        self._pairs: tuple[int, np.ndarray] | None = None  # the last epoch's
        self._ahead: _PairsAhead | None = None  # the next epoch's, being drawn (draw_ahead)
        self.pairs_drawn = 0  # the last epoch drawn's pairs before balancing: what --no-nsp-balance keeps

    @property
    def num_documents(self) -> int:
        return len(self.document_ids)

    def pairs(self, epoch: int) -> np.ndarray:
        """int64 [examples, PAIR_COLUMNS] of this epoch, in document order (see training.examples)."""
        if self._pairs is None or self._pairs[0] != epoch:
            if self._ahead is not None and self._ahead.epoch == epoch:
                pairs, self._ahead = self._ahead.result(), None
            else:
                pairs = finish(self._drawing(epoch))
            self._pairs = (epoch, pairs)
        return self._pairs[1]

    def draw_ahead(self, epoch: int, steps: int) -> None:
        """Draw `epoch`'s pairs over the next `steps` calls of draw_ahead_step. Drawing them is a pass over
        the whole corpus in Python (0.5 s for 64k pairs, minutes for a large corpus); the stream spreads
        the next epoch's over the batches of the one it enters, so that no data worker stops for it at
        the boundary."""
        if (self._pairs is None or self._pairs[0] != epoch) and (self._ahead is None or self._ahead.epoch != epoch):
            self._ahead = _PairsAhead(epoch, self._drawing(epoch, -(-self._sources // max(1, steps))))

    def draw_ahead_step(self) -> None:
        if self._ahead is not None:
            self._ahead.step()

    def _drawing(self, epoch: int, documents_per_step: int | None = None) -> Generator[None, None, np.ndarray]:
        """The same pairs for an epoch however they are drawn: their own seeded generator."""
        if self._sources < 2:
            return np.zeros((0, PAIR_COLUMNS), dtype=np.int64)
        rng = random.Random(_seed("pairs", self.pairing_seed, epoch))
        pairs = yield from draw_pairs(self.shards, self.document_ids, self.max_seq_len, self.short_seq_prob, rng,
                                      documents_per_step, spans=self.spans)
        self.pairs_drawn = len(pairs)
        return balance_labels(pairs, rng) if self.balance_nsp else pairs

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_ahead": None}  # a drawing in progress cannot be pickled (spawned workers)

    def num_examples(self, epoch: int) -> int:
        return len(self.pairs(epoch))

    def num_batches(self, epoch: int, batch_size: int, world_size: int = 1) -> int:
        """Batches each rank gets in `epoch` (the ragged tail is dropped)."""
        return self.num_examples(epoch) // (batch_size * world_size)

    def order(self, epoch: int, seed: int) -> np.ndarray:
        """The epoch's example indices in the order they are served."""
        return np.random.default_rng(_seed("order", seed, epoch)).permutation(self.num_examples(epoch))

    def example(self, epoch: int, seed: int, index: int) -> dict[str, np.ndarray | int]:
        """Example `index` of the epoch's pairs, masked: input_ids, token_type_ids, mlm_labels (each
        int64 [length]) and nsp_label."""
        a0, a1, b0, b1, label = self.pairs(epoch)[index, :NSP_LABEL + 1].tolist()
        len_a, len_b = a1 - a0, b1 - b0
        ids = np.empty(len_a + len_b + 3, dtype=np.int64)          # [CLS] A [SEP] B [SEP]
        ids[0], ids[len_a + 1], ids[-1] = self.cls_id, self.sep_id, self.sep_id
        ids[1: len_a + 1] = self.shards.tokens(a0, a1)
        ids[len_a + 2: -1] = self.shards.tokens(b0, b1)
        segment = np.zeros(len(ids), dtype=np.int64)
        segment[len_a + 2:] = 1
        masked, labels = self.masker(ids, np.random.default_rng(_seed("mask", seed, epoch, index)))
        return {"input_ids": masked, "token_type_ids": segment, "mlm_labels": labels, "nsp_label": label}

    def batches(self, epoch: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1,
                skip_batches: int = 0, stride: int = 1) -> Iterator[dict[str, torch.Tensor]]:
        """Deterministic given (seed, epoch). Global batch b is examples [b·W·B, (b+1)·W·B) of the
        shuffled epoch; rank r takes the r-th slice of B of it. Padded to the batch's longest sequence.
        Batches skip_batches, skip_batches + stride, ... (a data-loading worker's share)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world_size {world_size}")
        order = self.order(epoch, seed)
        for b in range(skip_batches, self.num_batches(epoch, batch_size, world_size), stride):
            first = (b * world_size + rank) * batch_size
            yield self._collate([self.example(epoch, seed, int(i)) for i in order[first: first + batch_size]])

    def every_batch(self, epoch: int, batch_size: int, seed: int,
                    max_examples: int | None = None) -> Iterator[dict[str, torch.Tensor]]:
        """All of the epoch's examples (or its first `max_examples`) in the order `batches` serves them,
        the last batch possibly smaller: an evaluation over the whole dataset, on one process."""
        order = self.order(epoch, seed)[:max_examples]
        for first in range(0, len(order), batch_size):
            yield self._collate([self.example(epoch, seed, int(i)) for i in order[first: first + batch_size]])

    def _collate(self, examples: list[dict]) -> dict[str, torch.Tensor]:
        length = max(len(e["input_ids"]) for e in examples)
        n = len(examples)
        input_ids = np.full((n, length), self.pad_id, dtype=np.int64)   # [B, S]
        token_type_ids = np.zeros((n, length), dtype=np.int64)
        attention_mask = np.zeros((n, length), dtype=np.int64)
        mlm_labels = np.full((n, length), -100, dtype=np.int64)
        for row, e in enumerate(examples):
            k = len(e["input_ids"])
            input_ids[row, :k] = e["input_ids"]
            token_type_ids[row, :k] = e["token_type_ids"]
            attention_mask[row, :k] = 1
            mlm_labels[row, :k] = e["mlm_labels"]
        return {"input_ids": torch.from_numpy(input_ids), "token_type_ids": torch.from_numpy(token_type_ids),
                "attention_mask": torch.from_numpy(attention_mask), "mlm_labels": torch.from_numpy(mlm_labels),
                "nsp_labels": torch.tensor([e["nsp_label"] for e in examples], dtype=torch.int64)}

    def most_frequent_token_id(self) -> int:
        """The commonest non-special token of these documents (the 'always predict it' MLM baseline)."""
        counts = self.shards.token_counts(self.document_ids).copy()
        counts[self.masker.is_special[: len(counts)]] = -1
        return int(np.argmax(counts))


@dataclass
class PreparedData:
    tokenizer: Tokenizer
    tokenizer_dir: Path
    train: PretrainingDataset
    heldout: PretrainingDataset
    stats: dict


# --- building the cache ---------------------------------------------------------------------------

def split_documents(n_documents: int, heldout_fraction: float, skipped_lines: int = 0,
                    text_field: str = "text") -> tuple[np.ndarray, np.ndarray]:
    """(train ids, held-out ids): held-out documents spread evenly over the corpus, at least two
    (NSP draws B from another document) unless the fraction is 0. `skipped_lines`: .jsonl lines that gave
    no document, which a refusal names (they may be the documents the corpus lacks)."""
    k = 0 if heldout_fraction == 0 else max(2, round(n_documents * heldout_fraction))
    skipped = (f" ({skipped_lines} .jsonl line(s) skipped: not JSON objects with a string `{text_field}` field; "
               f"--text-field names another)" if skipped_lines else "")
    if n_documents < 2:
        raise CorpusError(f"the corpus has {n_documents} document(s){skipped}; NSP needs at least two: separate "
                          f"documents with a blank line (.txt) or write one JSON line per document (.jsonl)")
    if n_documents - k < 2:
        raise CorpusError(f"the corpus has {n_documents} documents{skipped}, too few to hold out {k} and train on "
                          f"at least 2 (a held-out split takes 2 or more); add documents")
    heldout = np.unique(((np.arange(k) + 0.5) * n_documents / max(k, 1)).astype(np.int64))
    train = np.setdiff1d(np.arange(n_documents, dtype=np.int64), heldout, assume_unique=True)
    return train, heldout


@dataclass(frozen=True)
class HeldOut:
    """What the held-out evaluation reads of the held-out documents: `spans`, their runs of sentences that
    no training document holds, and how much was left out for being in training."""

    spans: Spans
    documents: int
    sentences: int
    sentences_in_training: int
    documents_in_training: int  # every sentence of it in training (a duplicated document)

    def line(self) -> str:
        return (f"held out {self.documents:,} documents, {self.sentences:,} sentences; left out of the held-out "
                f"evaluation as also in training documents: {self.sentences_in_training:,} sentences, "
                f"{self.documents_in_training:,} documents whole")


def unseen_spans(shards: TokenShards, heldout_ids: np.ndarray) -> HeldOut:
    """The held-out documents less every sentence that a document outside them also holds word for word (as
    the tokenizer reads it: a docstring copied into another package, a boilerplate line, a page crawled
    twice), as runs of consecutive sentences within a document: such a sentence would be scored on text the
    model trained on. Memory holds the held-out sentences' digests; the rest are compared a slice at a time."""
    heldout_ids = np.asarray(heldout_ids, dtype=np.int64)
    starts = shards.document_starts
    first, end = starts[heldout_ids], starts[heldout_ids + 1]
    lengths = end - first  # every document of the shards has a sentence
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    sentences = np.repeat(first - offsets[:-1], lengths) + np.arange(offsets[-1])  # the held-out ones, ascending
    digests = shards.sentence_digests
    held = digests[sentences]
    wanted = np.unique(held)
    seen = np.zeros(len(wanted), dtype=bool)
    for lo in range(0, shards.n_sentences if len(wanted) else 0, _SCAN_SENTENCES):
        hi = min(lo + _SCAN_SENTENCES, shards.n_sentences)
        outside = np.ones(hi - lo, dtype=bool)
        outside[sentences[np.searchsorted(sentences, lo): np.searchsorted(sentences, hi)] - lo] = False
        chunk = digests[lo:hi][outside]
        at = np.minimum(np.searchsorted(wanted, chunk), len(wanted) - 1)
        seen[at[wanted[at] == chunk]] = True
    kept = ~seen[np.searchsorted(wanted, held)]
    # a run starts at a kept sentence after a left-out one or a document's start, and ends likewise
    doc_first, doc_last = np.zeros(len(kept), dtype=bool), np.zeros(len(kept), dtype=bool)
    doc_first[offsets[:-1]], doc_last[offsets[1:] - 1] = True, True
    run_first = kept & (doc_first | ~np.concatenate([[False], kept[:-1]]))
    run_last = kept & (doc_last | ~np.concatenate([kept[1:], [False]]))
    run_first_at = np.flatnonzero(run_first)
    spans = Spans(sentences[run_first_at], sentences[run_last] + 1,
                  heldout_ids[np.searchsorted(offsets, run_first_at, side="right") - 1])
    kept_per_document = np.add.reduceat(kept.astype(np.int64), offsets[:-1]) if len(kept) else np.zeros(0, np.int64)
    return HeldOut(spans, len(heldout_ids), len(kept), int((~kept).sum()), int((kept_per_document == 0).sum()))


def _corpus_fingerprint(cfg: DataConfig) -> tuple[str, list[Path] | None]:
    """What identifies the corpus, and its files (None for the default corpus: extracted on build)."""
    if not cfg.corpus:
        return docstring_corpus_path(Path(cfg.cache_dir) / "docstrings").name, None
    files = resolve_corpus_files(cfg.corpus)
    parts = [f"{f}|{f.stat().st_size}|{f.stat().st_mtime_ns}" for f in files]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest(), files


def folder_tokenizer(folder: Path | str) -> Tokenizer:
    """A model folder's tokenizer as it is, minus any truncation or padding a tokenizer.json carries
    (they would cut or pad the sentences written to the shards)."""
    tokenizer = load_tokenizer_from_folder(folder)
    missing = [t for t in (PAD, CLS, SEP, MASK) if tokenizer.token_to_id(t) is None]
    if missing:
        raise ValueError(f"the tokenizer of {folder} lacks {', '.join(missing)}; pretraining needs a BERT vocabulary")
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def _cache_key(cfg: DataConfig, corpus_id: str) -> str:
    if cfg.tokenizer_dir is not None:  # keyed on what the tokenizer does, its lower-casing included
        vocab = "tokenizer:" + hashlib.sha256(folder_tokenizer(cfg.tokenizer_dir).to_str().encode()).hexdigest()
    elif cfg.vocab_file is not None:
        vocab_path = Path(cfg.vocab_file)
        if not vocab_path.is_file():
            raise ValueError(f"vocab file {cfg.vocab_file} does not exist")
        vocab = "file:" + hashlib.sha256(vocab_path.read_bytes()).hexdigest()
    else:
        vocab = f"train:{cfg.vocab_size}:{_MIN_FREQUENCY}"
    field = () if cfg.text_field == "text" else (cfg.text_field,)  # the caches made before it was named stay valid
    return hashlib.sha256(repr((_FORMAT, corpus_id, vocab, cfg.lowercase, *field)).encode()).hexdigest()[:16]


class _Progress:
    """How far a build has got: a bar per pass over the corpus on a terminal (`bars`); with `lines`, where
    no bar is drawn (a log file, or --no-progress), a line as each pass begins and ends and every
    _PROGRESS_LINE_S in between, for the minutes or hours a large corpus takes. Lines go to `stream` (stdout
    with the training's; stderr where stdout is an answer, as evaluate's --json), bars to stderr."""

    def __init__(self, bars: bool, lines: bool, stream: TextIO | None = None):
        self.bars, self.lines, self.stream = bars, lines, stream

    def say(self, text: str) -> None:
        if self.bars or self.lines:
            print(text, file=self.stream or sys.stdout, flush=True)

    def reading(self, documents: Iterable[Document], stats: CorpusStats, total: int, what: str) -> Iterator[Document]:
        """`documents`, followed through the `total` bytes of the corpus that `stats` counts as read."""
        started = last = time.monotonic()
        with tqdm(total=total, desc=what, unit="B", unit_scale=True, disable=None if self.bars else True,
                  mininterval=1.0) as bar:
            plain = bar.disable and self.lines
            for doc in documents:
                yield doc
                bar.update(stats.bytes_read - bar.n)
                if plain and time.monotonic() - last >= _PROGRESS_LINE_S:
                    last = time.monotonic()
                    self.say(f"{what}: {_size(stats.bytes_read)} of {_size(total)} read "
                             f"({100 * stats.bytes_read / max(total, 1):.0f}%), {tqdm.format_interval(last - started)}")
        self.say(f"{what}: {_size(stats.bytes_read)} read in {tqdm.format_interval(time.monotonic() - started)}")


def _size(n: int) -> str:
    return tqdm.format_sizeof(n, "B", 1000)


def _build(cfg: DataConfig, files: list[Path] | None, folder: Path, progress: _Progress,
           trained: Tokenizer | None) -> None:
    """Everything into a temporary sibling, renamed into place at the end (so it is whole or absent)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    # What killed builds left, of any settings (the corpus is often edited after a stop, which changes the
    # key); a live one's build is left alone.
    remove_stale_siblings(folder, names=r"data-[0-9a-f]+")
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    timings: dict[str, float] = {}
    try:
        started = time.perf_counter()
        if files is None:
            files = [docstring_corpus(Path(cfg.cache_dir) / "docstrings", show_progress=progress.bars)]
        timings["extract_s"] = time.perf_counter() - started

        started = time.perf_counter()
        tokenizer = named_tokenizer(cfg) or trained
        total = sum(f.stat().st_size for f in files)
        steps = "training a tokenizer on, then tokenising," if tokenizer is None else "tokenising"
        progress.say(f"preparing data in {folder}: {steps} {len(files):,} corpus file(s), {_size(total)}")
        if tokenizer is None:
            reads: list[CorpusStats] = []

            def sentences() -> Iterator[str]:  # train_wordpiece reads the corpus twice
                reads.append(CorpusStats())
                # the shards' pass below reads the same files again: it warns of their bad lines, once
                documents = progress.reading(read_documents(files, reads[-1], warn=False, text_field=cfg.text_field),
                                             reads[-1], total, f"tokenizer training, pass {len(reads)} of 2")
                return (s for doc in documents for s in doc)

            tokenizer = train_wordpiece(sentences, cfg.vocab_size, cfg.lowercase, _MIN_FREQUENCY)
            counted = reads[-1]
            # fail before tokenising a bad corpus
            split_documents(counted.documents, cfg.heldout_fraction, counted.bad_jsonl_lines, cfg.text_field)
        save_tokenizer(tokenizer, tmp / "tokenizer")
        timings["tokenizer_s"] = time.perf_counter() - started

        started = time.perf_counter()
        stats = CorpusStats()
        documents = read_documents(files, stats, text_field=cfg.text_field)
        meta = write_shards(progress.reading(documents, stats, total, "tokenising"), tokenizer, tmp / "shards")
        timings["tokenize_s"] = time.perf_counter() - started
        split_documents(meta["documents"], cfg.heldout_fraction, stats.bad_jsonl_lines, cfg.text_field)

        summary = {**asdict(stats), "documents": meta["documents"], "sentences": meta["sentences"],
                   "tokens": meta["tokens"], "vocab_size": meta["vocab_size"],
                   "corpus_files": [str(f) for f in files], **timings}
        (tmp / "corpus.json").write_text(json.dumps(summary, indent=2) + "\n")
        (tmp / _DONE).write_text("")
        try:
            os.rename(tmp, folder)
        except OSError:
            if not (folder / _DONE).is_file():  # not a concurrent build that finished first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    progress.say(f"prepared data in {folder}: {meta['documents']:,} documents, {meta['tokens']:,} tokens, in "
                 f"{tqdm.format_interval(sum(timings.values()))}")


def _wait_for(done: Path) -> None:
    """Until `done` appears; said once a minute (a warning: nothing configures logging, and a rank waiting
    for a cache that rank 0 wrote on another machine would wait silently)."""
    started = last_log = time.monotonic()
    while not done.is_file():
        if time.monotonic() - last_log > _WAIT_LOG_S:
            log.warning("waited %.0fs for %s, which rank 0 prepares: where the machines share no storage, copy "
                        "that folder from rank 0's machine to this path under another name, then rename it (this "
                        "rank reads it once its %s file is there)", time.monotonic() - started, done.parent,
                        done.name)
            last_log = time.monotonic()
        time.sleep(1.0)


def _is_write_error(error: OSError, cache_dir: Path) -> bool:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return error.filename is not None and Path(error.filename).absolute().is_relative_to(cache_dir.absolute())


# Above this share of [UNK] tokens a vocabulary does not fit the corpus: BERT's own on English text is
# well under 1%.
_UNKNOWN_WARN_RATE = 0.05


def _unknown_rate(tokenizer: Tokenizer, shards: TokenShards) -> float:
    counts, unk = shards.token_counts(), tokenizer.token_to_id(UNK)
    return float(counts[unk] / counts.sum()) if unk is not None and unk < len(counts) and counts.sum() else 0.0


def named_tokenizer(cfg: DataConfig) -> Tokenizer | None:
    """The tokenizer the settings name (a model folder's, or one over a vocab file), else None: one is
    trained on the corpus."""
    if cfg.tokenizer_dir is not None:
        return folder_tokenizer(cfg.tokenizer_dir)
    if cfg.vocab_file is not None:
        return tokenizer_from_vocab(cfg.vocab_file, cfg.lowercase, each_once=True)
    return None


def prepare_data(cfg: DataConfig, *, rank: int = 0, world_size: int = 1, show_progress: bool = True,
                 progress_lines: bool = False, progress_stream: TextIO | None = None,
                 trained: Tokenizer | None = None) -> PreparedData:
    """Builds (or loads from cache) the tokenizer and the token shards. Only rank 0 builds; other ranks
    wait for the cache's DONE marker, so it is safe to call on every rank. A build shows bars on a terminal
    (`show_progress`) and otherwise, with `progress_lines`, lines (_Progress, to `progress_stream`: stdout when
    None). `trained`, a tokenizer trained
    earlier on these settings (a resumed run's), is built with instead of training one: training again can
    give other ids (README)."""
    corpus_id, files = _corpus_fingerprint(cfg)
    folder = Path(cfg.cache_dir) / f"data-{_cache_key(cfg, corpus_id)}"
    built_now = False
    if not (folder / _DONE).is_file():
        if rank == 0:
            check_writable(Path(cfg.cache_dir), "--cache-dir")  # before the minutes a build takes
            try:
                _build(cfg, files, folder, _Progress(show_progress, progress_lines, progress_stream), trained)
            except OSError as e:
                if _is_write_error(e, Path(cfg.cache_dir)):  # a full disk, or the folder made read-only since
                    raise write_failed(folder, e) from e
                raise
            built_now = True
        else:
            _wait_for(folder / _DONE)

    tokenizer = load_tokenizer_from_folder(folder / "tokenizer")
    shards = TokenShards(folder / "shards")
    unknown_rate = _unknown_rate(tokenizer, shards)
    if rank == 0 and unknown_rate > _UNKNOWN_WARN_RATE:
        log.warning("the tokenizer reads %.0f%% of the corpus's tokens as %s: its vocabulary does not fit this "
                    "text (another language or script, or cased text with --no-lowercase?), and the model "
                    "learns nothing from those tokens", 100 * unknown_rate, UNK)
    train_ids, heldout_ids = split_documents(shards.n_documents, cfg.heldout_fraction)
    unseen = unseen_spans(shards, heldout_ids)
    masker = Masker(tokenizer, cfg.masked_lm_prob, cfg.max_predictions_per_seq, cfg.whole_word_masking)

    def dataset(ids: np.ndarray, spans: Spans | None = None) -> PretrainingDataset:
        return PretrainingDataset(shards, ids, tokenizer, max_seq_len=cfg.max_seq_len,
                                  short_seq_prob=cfg.short_seq_prob, masker=masker, balance_nsp=cfg.balance_nsp,
                                  spans=spans)

    train, heldout = dataset(train_ids), dataset(heldout_ids, unseen.spans)
    corpus = json.loads((folder / "corpus.json").read_text())
    # Lone-sentence chunks always get a random B (as in the original), so short documents tip NSP towards
    # NotNext unless balance_nsp: the run summary reports the real rate and its majority baseline.
    epoch0 = train.pairs(0)
    stats = {**corpus, "train_documents": len(train_ids), "heldout_documents": len(heldout_ids),
             "heldout_sentences": unseen.sentences, "heldout_sentences_in_training": unseen.sentences_in_training,
             "heldout_documents_in_training": unseen.documents_in_training, "heldout": unseen.line(),
             "train_examples_epoch0": len(epoch0),
             "is_next_rate": float(np.mean(epoch0[:, NSP_LABEL] == IS_NEXT)) if len(epoch0) else 0.0,
             "unknown_token_rate": round(unknown_rate, 4), "cache": str(folder), "built_now": built_now,
             "corpus": "python docstrings (default)" if not cfg.corpus else ", ".join(cfg.corpus)}
    return PreparedData(tokenizer, folder / "tokenizer", train, heldout, stats)
