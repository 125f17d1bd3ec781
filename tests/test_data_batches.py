"""What the trainer sees: batch layout, determinism, resuming, ranks, held-out split and the cache."""
from __future__ import annotations

import json
import pickle
import random
import threading

import numpy as np
import pytest
import torch

from data_corpora import prepare, sentence, write_txt_corpus
from training.batch_stream import BatchStream
from training.data import DataConfig, prepare_data, split_documents, unseen_spans
from training.shards import TokenShards, write_shards
from training.wordpiece import CLS, PAD, SEP, SPECIAL_TOKENS, save_tokenizer

MAX_SEQ_LEN = 48


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("batches")
    return tmp, write_txt_corpus(tmp / "c.txt", n_docs=400, sentences=(2, 10), words=(3, 9))


@pytest.fixture(scope="module")
def data(corpus):
    return prepare(*corpus, max_seq_len=MAX_SEQ_LEN)


def _rows(batch):
    """Each example of a batch without its padding, as a tuple of lists (comparable across paddings)."""
    out = []
    for r in range(len(batch["input_ids"])):
        n = int(batch["attention_mask"][r].sum())
        out.append(tuple(tuple(batch[k][r, :n].tolist()) for k in ("input_ids", "token_type_ids", "mlm_labels"))
                   + (int(batch["nsp_labels"][r]),))
    return out


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_batch_layout(data):
    ids_of = data.tokenizer.token_to_id
    batches = list(data.train.batches(epoch=0, batch_size=32, seed=0))
    assert len(batches) == data.train.num_batches(0, 32) == data.train.num_examples(0) // 32
    for batch in batches:
        assert set(batch) == {"input_ids", "token_type_ids", "attention_mask", "mlm_labels", "nsp_labels"}
        assert all(t.dtype == torch.int64 for t in batch.values())
        b, s = batch["input_ids"].shape
        assert b == 32 and batch["nsp_labels"].shape == (32,) and s <= MAX_SEQ_LEN
        lengths = batch["attention_mask"].sum(1)
        assert int(lengths.max()) == s  # padded to the longest, not to max_seq_len
        for r in range(b):
            n = int(lengths[r])
            ids, types, mask, labels = (batch[k][r] for k in ("input_ids", "token_type_ids", "attention_mask",
                                                               "mlm_labels"))
            original = torch.where(labels == -100, ids, labels)
            seps = (original[:n] == ids_of(SEP)).nonzero().flatten().tolist()
            assert original[0] == ids_of(CLS) and len(seps) == 2 and seps[1] == n - 1 and 1 < seps[0] < n - 2
            assert types[: seps[0] + 1].eq(0).all() and types[seps[0] + 1: n].eq(1).all() and types[n:].eq(0).all()
            assert mask[:n].eq(1).all() and mask[n:].eq(0).all()
            assert ids[n:].eq(ids_of(PAD)).all() and labels[n:].eq(-100).all()
        assert set(batch["nsp_labels"].tolist()) <= {0, 1}


def test_same_seed_and_epoch_give_identical_batches(corpus, data):
    first = list(data.train.batches(1, 16, seed=5))
    again = prepare(*corpus, max_seq_len=MAX_SEQ_LEN)  # a fresh object, from the cache
    second = list(again.train.batches(1, 16, seed=5))
    assert len(first) == len(second) and all(_equal(a, b) for a, b in zip(first, second))


def test_other_epoch_or_seed_changes_pairs_order_and_masks(data):
    base = _rows(next(data.train.batches(0, 64, seed=0)))
    other_epoch = _rows(next(data.train.batches(1, 64, seed=0)))
    other_seed = _rows(next(data.train.batches(0, 64, seed=1)))
    assert not set(base) & set(other_epoch)
    assert not set(base) & set(other_seed)
    # Same example (same pair) in another epoch's masks: the pair is the same, the masks differ.
    e0, e1 = data.train.example(0, seed=0, index=3), data.train.example(0, seed=1, index=3)
    original = lambda e: np.where(e["mlm_labels"] == -100, e["input_ids"], e["mlm_labels"])  # noqa: E731
    assert np.array_equal(original(e0), original(e1)) and not np.array_equal(e0["mlm_labels"], e1["mlm_labels"])


def test_skip_batches_resumes_exactly(data):
    full = list(data.train.batches(2, 8, seed=9))
    resumed = list(data.train.batches(2, 8, seed=9, skip_batches=5))
    assert len(resumed) == len(full) - 5 and all(_equal(a, b) for a, b in zip(full[5:], resumed))


def test_ranks_get_disjoint_equal_shares_of_the_epoch(data):
    """Rank r of W takes slice r of each global batch: two ranks of 4 == one rank of 8, row for row."""
    single = [_rows(b) for b in data.train.batches(0, 8, seed=4)]
    ranks = [[_rows(b) for b in data.train.batches(0, 4, seed=4, rank=r, world_size=2)] for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == len(single) == data.train.num_batches(0, 4, world_size=2)
    assert [r0 + r1 for r0, r1 in zip(*ranks)] == single
    seen = [row for rank in ranks for batch in rank for row in batch]
    assert len(set(seen)) == len(seen)
    with pytest.raises(ValueError):
        next(data.train.batches(0, 4, seed=4, rank=2, world_size=2))


def test_heldout_documents_are_few_spread_and_disjoint(data):
    train, heldout = data.train.document_ids, data.heldout.document_ids
    n = data.stats["documents"]
    assert len(heldout) == max(2, round(0.01 * n)) and not set(train) & set(heldout)
    assert len(train) + len(heldout) == n
    assert data.heldout.num_examples(0) > 0 and next(data.heldout.batches(0, 2, seed=0))
    assert split_documents(1000, 0.02)[1].tolist() == [25, 75, 125, 175, 225, 275, 325, 375, 425, 475, 525,
                                                       575, 625, 675, 725, 775, 825, 875, 925, 975]
    assert len(split_documents(10, 0.0)[1]) == 0


def test_heldout_pairs_hold_no_sentence_of_a_training_document(tmp_path, monkeypatch):
    """Text on both sides of the split (documents copied whole, a boilerplate line in many) is left out of the
    held-out evaluation, on the real preparation path: no held-out pair reads a sentence that a training
    document holds, and the stats say how much was left out."""
    rng = random.Random(5)
    docs = [[sentence(rng, 4, 9) for _ in range(rng.randint(3, 7))] for _ in range(150)]
    for i in range(0, 150, 3):
        docs[i].insert(1, "Thanks for reading, and see the docs for more.")
    for i in range(0, 150, 20):
        docs[i + 5] = list(docs[i])  # held out: every tenth document from the 5th, 8 of the 15 copies
    corpus = tmp_path / "c.txt"
    corpus.write_text("\n\n".join("\n".join(d) for d in docs) + "\n")
    data = prepare(tmp_path, corpus, max_seq_len=MAX_SEQ_LEN, heldout_fraction=0.1)
    shards = data.train.shards
    starts, doc_starts = shards.sentence_starts, shards.document_starts

    def text(s):
        return tuple(shards.tokens(int(starts[s]), int(starts[s + 1])).tolist())

    def sentences(d):
        return range(int(doc_starts[d]), int(doc_starts[d + 1]))

    trained = {text(s) for d in data.train.document_ids for s in sentences(d)}
    seen = [[text(s) in trained for s in sentences(d)] for d in data.heldout.document_ids]
    assert sum(all(d) for d in seen) == 8 and sum(any(d) and not all(d) for d in seen) == 3  # as built
    for epoch in range(3):
        for a0, a1, b0, b1 in data.heldout.pairs(epoch)[:, :4].tolist():
            for t0, t1 in ((a0, a1), (b0, b1)):  # every sentence the range overlaps
                for s in range(int(np.searchsorted(starts, t0, side="right")) - 1, int(np.searchsorted(starts, t1))):
                    assert text(s) not in trained
    assert data.heldout.num_examples(0) >= 8  # what is left of the 4 clean and 3 partial documents
    s = data.stats
    assert (s["heldout_documents"], s["heldout_sentences"]) == (15, sum(map(len, seen)))
    assert s["heldout_sentences_in_training"] == sum(map(sum, seen)) and s["heldout_documents_in_training"] == 8
    assert s["heldout"] == (f"held out 15 documents, {s['heldout_sentences']:,} sentences; left out of the held-out "
                            f"evaluation as also in training documents: {s['heldout_sentences_in_training']:,} "
                            f"sentences, 8 documents whole")
    # compared a slice of the corpus at a time, the same runs
    monkeypatch.setattr("training.data._SCAN_SENTENCES", 7)
    again = unseen_spans(shards, data.heldout.document_ids).spans
    assert all(np.array_equal(x, y) for x, y in zip(again, data.heldout.spans))


def test_most_frequent_token_is_counted_over_the_datasets_own_documents(data):
    shards = data.train.shards
    special = [data.tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    for ds in (data.train, data.heldout):
        counts = np.zeros(shards.vocab_size, dtype=np.int64)
        for d in ds.document_ids:
            s0, s1 = shards.document_starts[d], shards.document_starts[d + 1]
            counts += np.bincount(shards.tokens(shards.sentence_starts[s0], shards.sentence_starts[s1]),
                                  minlength=shards.vocab_size)
        counts[special] = -1
        assert ds.most_frequent_token_id() == int(np.argmax(counts))


def test_stats_describe_the_corpus(data):
    s = data.stats
    assert s["documents"] == 400 and s["sentences"] >= 800 and s["tokens"] > s["words"] > 0
    assert s["train_documents"] + s["heldout_documents"] == 400 and "is_next_rate" in s


# --- the cache --------------------------------------------------------------------------------------

def test_the_cache_is_reused_and_invalidated_by_what_made_it(tmp_path, monkeypatch):
    corpus = write_txt_corpus(tmp_path / "c.txt", n_docs=50, sentences=(2, 5), words=(3, 8))
    cfg = DataConfig(corpus=(str(corpus),), vocab_size=200, cache_dir=str(tmp_path / "cache"))
    first = prepare_data(cfg)
    assert first.stats["built_now"]
    assert (first.tokenizer_dir / "vocab.txt").is_file() and (first.tokenizer_dir / "tokenizer.json").is_file()

    import training.data as data_module
    with monkeypatch.context() as m:
        m.setattr(data_module, "write_shards", lambda *a, **k: pytest.fail("rebuilt a cached corpus"))
        again = prepare_data(DataConfig(**{**cfg.__dict__, "max_seq_len": 64, "whole_word_masking": True}),
                             show_progress=False)
        assert not again.stats["built_now"] and again.stats["cache"] == first.stats["cache"]
        on_rank_1 = prepare_data(cfg, rank=1, world_size=2)
        assert on_rank_1.stats["cache"] == first.stats["cache"]

    cased = prepare_data(DataConfig(**{**cfg.__dict__, "lowercase": False}))
    assert cased.stats["built_now"] and cased.stats["cache"] != first.stats["cache"]
    with corpus.open("a") as f:
        f.write("\nOne more document appears here.\n")
    grown = prepare_data(cfg)
    assert grown.stats["built_now"] and grown.stats["documents"] == 51
    assert len(list((tmp_path / "cache").glob(".*tmp"))) == 0  # no temporary folders left


def test_a_killed_builds_folder_goes_with_the_next_build_whatever_its_settings(tmp_path):
    """A build killed with -9 leaves its temporary folder; the corpus is then often edited, which gives the
    next build another key: that one removes it too (it was left for good), never a live process's."""
    import subprocess
    import sys
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    cache = tmp_path / "cache"
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as alive:
        killed, live = (cache / f".data-0123456789abcdef.{p.pid}.tmp" for p in (dead, alive))
        for folder in (killed, live):
            (folder / "shards").mkdir(parents=True)
            (folder / "shards" / "tokens-00000.bin").write_bytes(b"\0" * 1000)
        corpus = write_txt_corpus(tmp_path / "c.txt", n_docs=30, sentences=(2, 4), words=(3, 8))
        prepare_data(DataConfig(corpus=(str(corpus),), vocab_size=200, cache_dir=str(cache)))
        assert not killed.exists() and live.exists()
        alive.kill()


def test_a_full_disk_while_the_tokenizer_is_saved_is_one_line(tmp_path, monkeypatch):
    """tokenizers reports a full disk as a bare Exception, which came out as a traceback; it is now the one
    line of any other full disk, and nothing is left in the cache."""
    import training.data as data_module
    from training.writes import WriteError

    def save_on_a_full_disk(tok, out_dir):
        out_dir.mkdir(parents=True)
        (out_dir / "tokenizer.json").symlink_to("/dev/full")  # every write: ENOSPC
        save_tokenizer(tok, out_dir)

    monkeypatch.setattr(data_module, "save_tokenizer", save_on_a_full_disk)
    corpus = write_txt_corpus(tmp_path / "c.txt", n_docs=30, sentences=(2, 4), words=(3, 8))
    with pytest.raises(WriteError, match=r"^no space left on device writing .*cache/data-\w+$"):
        prepare_data(DataConfig(corpus=(str(corpus),), vocab_size=200, cache_dir=str(tmp_path / "cache")),
                     show_progress=False)
    assert not list((tmp_path / "cache").iterdir())


def test_a_build_says_how_far_it_has_got_where_no_bar_is_drawn(tmp_path, monkeypatch, capsys):
    """In a log file a build of a large corpus said nothing for as long as it took (20 minutes for 1.5 GB):
    now a line as each pass over the corpus begins and ends, and a line a minute in between."""
    import gzip

    import training.data as data_module
    monkeypatch.setattr(data_module, "_PROGRESS_LINE_S", 0.0)
    corpus = write_txt_corpus(tmp_path / "c.txt", n_docs=60, sentences=(2, 4), words=(3, 8))
    packed = tmp_path / "d.txt.gz"
    packed.write_bytes(gzip.compress(corpus.read_bytes()))
    size = corpus.stat().st_size + packed.stat().st_size
    prepare_data(DataConfig(corpus=(str(corpus), str(packed)), vocab_size=200, cache_dir=str(tmp_path / "cache")),
                 show_progress=False, progress_lines=True)
    lines = capsys.readouterr().out.splitlines()
    shown = data_module._size(size)  # the .gz counted as stored (compressed), so that the passes end at 100%
    assert lines[0].startswith("preparing data in ")
    assert lines[0].endswith(f": training a tokenizer on, then tokenising, 2 corpus file(s), {shown}")
    for what in ("tokenizer training, pass 1 of 2", "tokenizer training, pass 2 of 2", "tokenising"):
        during = [line for line in lines if line.startswith(f"{what}: ") and "%" in line]
        assert during and during[-1].startswith(f"{what}: {shown} of {shown} read (100%), "), lines
        assert f"{what}: {shown} read in 00:0" in "\n".join(lines)
    assert lines[-1].startswith("prepared data in ") and ": 120 documents, " in lines[-1]
    assert json.loads((next((tmp_path / "cache").glob("data-*")) / "corpus.json").read_text())["bytes_read"] == size


def test_other_ranks_wait_for_rank_0(tmp_path):
    corpus = write_txt_corpus(tmp_path / "c.txt", n_docs=30, sentences=(2, 4), words=(3, 8))
    cfg = DataConfig(corpus=(str(corpus),), vocab_size=200, cache_dir=str(tmp_path / "cache"))
    result = {}
    waiter = threading.Thread(target=lambda: result.update(r1=prepare_data(cfg, rank=1, show_progress=False)))
    waiter.start()
    waiter.join(timeout=1.5)
    assert waiter.is_alive()  # nothing built yet: rank 1 waits
    built = prepare_data(cfg, rank=0)
    waiter.join(timeout=10)
    assert not waiter.is_alive() and result["r1"].stats["cache"] == built.stats["cache"]


def test_the_same_corpus_trains_the_same_vocabulary_in_every_process(tmp_path):
    """The tokenizers library's WordPiece trainer numbers word-continuing pieces in a hash map's order,
    which each process seeds anew, and breaks ties between merges by those numbers (huggingface/tokenizers
    #1794): the same corpus got another vocabulary on every run. Prepared in three processes with empty
    caches, it now gets one, and a "##" piece typed in a text is read as text, not as that piece."""
    import subprocess
    import sys
    from pathlib import Path

    corpus = write_txt_corpus(tmp_path / "c.txt", n_docs=300, sentences=(2, 5), words=(3, 12))
    script = ("import json, sys; from training.data import DataConfig, prepare_data; "
              "t = prepare_data(DataConfig(corpus=(sys.argv[1],), vocab_size=300, cache_dir=sys.argv[2]), "
              "show_progress=False).tokenizer; "
              "pieces = sorted(p for p in t.get_vocab() if p.startswith('##') and len(p) == 3); "
              "print(json.dumps([t.get_vocab(), pieces, t.encode(' '.join(pieces)).tokens]))")
    runs = [json.loads(subprocess.run([sys.executable, "-c", script, str(corpus), str(tmp_path / f"cache{i}")],
                                      capture_output=True, text=True, check=True,
                                      cwd=Path(__file__).resolve().parents[1]).stdout)
            for i in range(3)]
    vocab, pieces, tokens = runs[0]
    assert len(vocab) == 300 and [vocab[t] for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert all(run == runs[0] for run in runs[1:])
    assert len(pieces) > 10 and not set(pieces) & set(tokens)  # "##e" typed: "#", "#", "e"


def test_an_existing_vocab_file_is_used(tmp_path, data):
    vocab = data.tokenizer_dir / "vocab.txt"
    corpus = write_txt_corpus(tmp_path / "c.txt", n_docs=30, sentences=(2, 4), words=(3, 8))
    prepared = prepare_data(DataConfig(corpus=(str(corpus),), vocab_file=str(vocab), cache_dir=str(tmp_path)),
                            show_progress=False)
    assert prepared.tokenizer.get_vocab() == data.tokenizer.get_vocab()
    with pytest.raises(ValueError, match="does not exist"):
        prepare_data(DataConfig(corpus=(str(corpus),), vocab_file=str(tmp_path / "none.txt")))


def test_documents_never_span_token_files(tmp_path, data):
    docs = [[f"Document {d} sentence {s} has words." for s in range(d % 5 + 1)] for d in range(200)]
    one = write_shards(docs, data.tokenizer, tmp_path / "one")
    many = write_shards(docs, data.tokenizer, tmp_path / "many", shard_tokens=100)
    assert len(one["shards"]) == 1 and len(many["shards"]) > 10
    a, b = TokenShards(tmp_path / "one"), TokenShards(tmp_path / "many")
    assert np.array_equal(a.sentence_starts, b.sentence_starts) and np.array_equal(a.document_starts, b.document_starts)
    for d in range(200):
        lo, hi = (int(a.sentence_starts[a.document_starts[i]]) for i in (d, d + 1))
        assert np.array_equal(a.tokens(lo, hi), b.tokens(lo, hi))
    # "[SEP]" written in the text stays text.
    sep = data.tokenizer.token_to_id(SEP)
    special = write_shards([["Put [SEP] and [MASK] here."], ["x"]], data.tokenizer, tmp_path / "sp")
    assert special["tokens"] > 4 and sep not in TokenShards(tmp_path / "sp").tokens(0, special["tokens"])


@pytest.mark.parametrize("bad", [{"max_seq_len": 4}, {"masked_lm_prob": 0.0}, {"short_seq_prob": 1.5},
                                 {"heldout_fraction": 0.9}, {"vocab_size": 50}, {"max_predictions_per_seq": 0}])
def test_bad_settings_are_refused(bad):
    with pytest.raises(ValueError):
        DataConfig(**bad)


# --- the next epoch's pairs, drawn ahead ------------------------------------------------------------------

@pytest.fixture
def drawing_steps(monkeypatch):
    """How many documents each step of each pair drawing covered: one list per drawing started."""
    import training.data
    drawings, real = [], training.data.draw_pairs

    def recording(shards, document_ids, *args, **kwargs):
        steps = []
        drawings.append(steps)
        per_step = args[-1] or len(document_ids)
        drawing = real(shards, document_ids, *args, **kwargs)
        while True:
            try:
                next(drawing)
            except StopIteration as done:
                steps.append(len(document_ids) - per_step * len(steps))
                return done.value
            steps.append(per_step)
            yield
    monkeypatch.setattr(training.data, "draw_pairs", recording)
    return drawings


def test_the_next_epochs_pairs_are_drawn_a_step_at_a_time_and_are_the_epochs_own(corpus, drawing_steps):
    fresh = prepare(*corpus, max_seq_len=MAX_SEQ_LEN).train
    want = prepare(*corpus, max_seq_len=MAX_SEQ_LEN).train.pairs(3)
    drawing_steps.clear()
    fresh.draw_ahead(3, steps=4)
    fresh.draw_ahead(3, steps=4)  # already being drawn: not twice
    for _ in range(4):
        fresh.draw_ahead_step()
    documents = fresh.num_documents
    assert drawing_steps == [[-(-documents // 4)] * 3 + [documents - 3 * -(-documents // 4)]]
    assert np.array_equal(fresh.pairs(3), want)
    assert len(drawing_steps) == 1  # taken as drawn, not drawn again
    fresh.draw_ahead(4, steps=100)
    fresh.draw_ahead_step()
    copy = pickle.loads(pickle.dumps(fresh))  # a spawned worker's copy, drawing in progress: it draws its own
    want = prepare(*corpus, max_seq_len=MAX_SEQ_LEN).train.pairs(4)
    assert np.array_equal(fresh.pairs(4), want) and np.array_equal(copy.pairs(4), want)  # finished, or drawn


def test_the_stream_draws_each_next_epoch_over_the_batches_of_the_one_before(corpus, drawing_steps):
    """Every epoch's pairs but the first come from a drawing spread over the batches of the epoch before,
    and the batches are those of a stream that draws nothing ahead."""
    reference = prepare(*corpus, max_seq_len=MAX_SEQ_LEN).train
    counts = [reference.num_batches(e, 8) for e in range(2)]
    data = prepare(*corpus, max_seq_len=MAX_SEQ_LEN).train
    data.pairs(0)  # as the trainer does before it starts the stream
    drawing_steps.clear()
    stream = BatchStream(data, 8, seed=0)
    got = [stream.next() for _ in range(sum(counts) + 1)]
    assert [b.epoch for b in got] == [0] * counts[0] + [1] * counts[1] + [2]
    assert len(drawing_steps) == 2 and all(len(steps) > 1 for steps in drawing_steps)  # epochs 1 and 2
    want = [b for e in range(3) for b in reference.batches(e, 8, seed=0)][:len(got)]
    assert all(_equal(a.inputs, b) for a, b in zip(got, want))
