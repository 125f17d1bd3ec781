"""Reading corpora: sentence splitting, .txt/.jsonl documents, bad input, and the docstring corpus."""
from __future__ import annotations

import json
import logging
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from tests.data_corpora import prepare, write_txt_corpus
from training import corpus as corpus_module
from training import docstring_corpus as dc
from training.corpus import (MAX_DOCUMENT_SENTENCES, MAX_SENTENCE_CHARS, CorpusError, CorpusStats, read_documents,
                             resolve_corpus_files, split_sentences)
from training.data import DataConfig, prepare_data


def test_split_sentences_keeps_abbreviations_and_splits_real_stops():
    text = ('Use a list, e.g. Python lists, i.e. Mutable ones. Dr. Smith agreed! Did he? "Yes." '
            'Version 3.11 is out. J. R. R. Tolkien wrote it. lower case after a stop stays. 42 is last')
    assert split_sentences(text) == [
        "Use a list, e.g. Python lists, i.e. Mutable ones.", "Dr. Smith agreed!", "Did he?", '"Yes."',
        "Version 3.11 is out.", "J. R. R. Tolkien wrote it. lower case after a stop stays.", "42 is last"]


def test_txt_documents_are_separated_by_blank_lines(tmp_path):
    f = tmp_path / "c.txt"
    f.write_text("First doc line one. Still one!\nLine two.\n\n\n  \nSecond doc.\n\nThird doc\n", encoding="utf-8")
    stats = CorpusStats()
    docs = list(read_documents([f], stats))
    assert docs == [["First doc line one.", "Still one!", "Line two."], ["Second doc."], ["Third doc"]]
    assert (stats.documents, stats.sentences, stats.words) == (3, 5, 12)


def test_jsonl_documents_skip_and_count_bad_lines(tmp_path, caplog):
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"text": "One. Two.\n\nThree."}) + "\nnot json\n" + json.dumps({"title": "x"})
                 + "\n\n" + json.dumps({"text": "Four."}) + "\n", encoding="utf-8")
    stats = CorpusStats()
    with caplog.at_level(logging.WARNING):
        docs = list(read_documents([f], stats))
    assert docs == [["One.", "Two.", "Three."], ["Four."]]
    assert stats.bad_jsonl_lines == 2 and "skipped 2 lines" in caplog.text


def test_data_preparation_warns_of_a_files_bad_lines_once(tmp_path, caplog):
    """The tokenizer's pass and the shards' pass both read the corpus: one warning per file and problem."""
    f = tmp_path / "c.jsonl"
    docs = [json.dumps({"text": f"Document {i} has a sentence. And another one about {i}."}) for i in range(40)]
    f.write_bytes("\n".join([*docs, "not json", json.dumps({"title": "no text"})]).encode()
                  + b'\n{"text": "Bad \xff bytes. Still a document."}\n')
    with caplog.at_level(logging.WARNING):
        data = prepare_data(DataConfig(corpus=(str(f),), vocab_size=200, cache_dir=str(tmp_path / "cache")),
                            show_progress=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"{f}: skipped 2 lines that are not JSON objects with a string `text` field",
                        f"{f}: 1 lines had bytes that are not UTF-8 (replaced by U+FFFD, which the tokenizer "
                        f"drops); if it is in another encoding, convert it to UTF-8, e.g. iconv -f CP1252 -t UTF-8 "
                        f"for Windows text"], warnings
    assert data.stats["bad_jsonl_lines"] == 2 and data.stats["documents"] == 41


def test_a_corpus_refused_for_too_few_documents_names_the_jsonl_lines_it_skipped(tmp_path):
    """Every line bad: the refusal comes before the pass that warns of them, so it says so itself."""
    f = tmp_path / "c.jsonl"
    f.write_text('{not json\n{"body": 1}\n' + json.dumps({"text": "One document."}) + "\n")
    with pytest.raises(CorpusError, match=r"has 1 document\(s\) \(2 \.jsonl line\(s\) skipped: not JSON objects"):
        prepare_data(DataConfig(corpus=(str(f),), vocab_size=200, cache_dir=str(tmp_path / "cache")),
                     show_progress=False)


def test_jsonl_documents_in_another_field_are_read_with_text_field(tmp_path, caplog):
    """A dump whose documents are in `content` (or `body`, `raw_content`): refused as documents too few,
    with the flag that reads them named; read with it, into a cache of its own."""
    f = tmp_path / "c.jsonl"
    f.write_text("".join(json.dumps({"id": i, "content": f"Document {i} has a sentence. And another about {i}."})
                         + "\n" for i in range(40)) + json.dumps({"content": {"nested": "no"}}) + "\n")
    cfg = DataConfig(corpus=(str(f),), vocab_size=200, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(CorpusError, match=r"\(41 \.jsonl line\(s\) skipped: not JSON objects with a string `text` "
                                          r"field; --text-field names another\)"):
        prepare_data(cfg, show_progress=False)
    with caplog.at_level(logging.WARNING):
        data = prepare_data(DataConfig(**{**cfg.__dict__, "text_field": "content"}), show_progress=False)
    assert data.stats["documents"] == 40 and data.stats["bad_jsonl_lines"] == 1
    assert f"{f}: skipped 1 lines that are not JSON objects with a string `content` field" in caplog.text
    assert list(read_documents([f], text_field="content"))[0] == ["Document 0 has a sentence.", "And another about 0."]
    with pytest.raises(ValueError, match="--text-field content names a field of your .jsonl corpus; pass --corpus"):
        DataConfig(text_field="content")


def test_a_jsonl_escape_of_half_an_emoji_is_replaced_and_warned(tmp_path, caplog):
    """{"text": "... \\ud83d ..."}, a surrogate with no pair (JavaScript cuts strings between the halves of an
    emoji), stopped the tokenizer's training with a UnicodeEncodeError traceback."""
    f = tmp_path / "c.jsonl"
    f.write_text("".join(json.dumps({"text": f"Tweet {i} was cut \ud83d here. And another about {i} \ud83d\ude00."})
                         + "\n" for i in range(30)))
    with caplog.at_level(logging.WARNING):
        data = prepare(tmp_path, f, vocab_size=200)
    assert data.stats["documents"] == 30 and data.stats["lines_with_bad_bytes"] == 30
    assert f"{f}: 30 lines had" in caplog.text
    shards = data.train.shards
    first = shards.document_starts[data.train.document_ids[0]]
    text = data.tokenizer.decode(shards.tokens(*shards.sentence_starts[first:first + 2]).tolist())
    assert text == "tweet 0 was cut here."


def test_a_cp1252_file_is_warned_of_with_the_conversion_that_reads_it(tmp_path, caplog):
    """Smart quotes and accents of Windows text are not UTF-8: the warning said they were replaced, not that
    the tokenizer then drops them ("café" trains as "caf") nor how to convert the file."""
    f = tmp_path / "c.txt"
    f.write_bytes("He said \u201cCaf\u00e9\u201d.\n\nOther doc.\n".encode("cp1252"))
    with caplog.at_level(logging.WARNING):
        assert list(read_documents([f])) == [["He said \ufffdCaf\ufffd."], ["Other doc."]]
    assert "which the tokenizer drops" in caplog.text and "iconv -f CP1252 -t UTF-8" in caplog.text
    converted = f.read_bytes().decode("cp1252").encode()  # what the iconv it names writes
    f.write_bytes(converted)
    assert list(read_documents([f])) == [["He said \u201cCaf\u00e9\u201d."], ["Other doc."]]


def test_undecodable_bytes_are_replaced_counted_and_warned(tmp_path, caplog):
    f = tmp_path / "c.txt"
    f.write_bytes(b"Good line.\nBad \xff\xfe bytes here.\n\nOther doc \xc3\x28.\n")
    stats = CorpusStats()
    with caplog.at_level(logging.WARNING):
        docs = list(read_documents([f], stats))
    assert len(docs) == 2 and "\ufffd" in docs[0][1]
    assert stats.lines_with_bad_bytes == 2 and stats.files_with_bad_bytes == [str(f)]
    assert "not UTF-8" in caplog.text


def test_txt_lines_end_at_a_lone_cr_and_the_other_line_ends_jsonl_text_ends_at(tmp_path, monkeypatch):
    """A file saved with \\r alone (classic Mac OS) was one document (refused as too few, or trained without
    its document boundaries); \\v, \\f and NEL inside a line, which the tokenizer deletes, glued two words into
    one. A \\r\\n that a read piece's end cuts in two is still one line end."""
    docs = ["First doc, line one.", "Line two."], ["Second doc.", "More."], ["Third doc."]
    text = "\n\n".join("\n".join(d) for d in docs)
    for ending in ("\r", "\r\n", "\n"):
        f = tmp_path / f"c{len(ending)}{ending == chr(10)}.txt"
        f.write_bytes(text.replace("\n", ending).encode())
        assert list(read_documents([f])) == [list(d) for d in docs], repr(ending)
    f = tmp_path / "separators.txt"
    f.write_text("One\vtwo\fthree\x85four\u2028five.\n\x0c\nNext doc.\n", encoding="utf-8", newline="")
    assert list(read_documents([f])) == [["One", "two", "three", "four", "five."], ["Next doc."]]
    data = prepare(tmp_path, tmp_path / "c1False.txt", vocab_size=200, heldout_fraction=0)
    shards = data.train.shards
    decoded = [data.tokenizer.decode(shards.tokens(*shards.sentence_starts[i:i + 2]).tolist())
               for i in range(shards.n_sentences)]
    assert decoded == ["first doc, line one.", "line two.", "second doc.", "more.", "third doc."]
    assert shards.n_documents == 3
    for size in range(3, 12):  # read pieces ending at every byte of the text, between \r and \n among them
        monkeypatch.setattr(corpus_module, "_READ_BYTES", size)
        for name in ("c1False.txt", "c2False.txt"):
            assert list(read_documents([tmp_path / name])) == [list(d) for d in docs], (size, name)


@pytest.mark.parametrize("line", ["word " * 2_000_000, "x" * 10_000_000, "Short one. " * 900_000])
def test_a_10mb_line_is_read_in_bounded_sentences(tmp_path, line):
    f = tmp_path / "big.txt"
    f.write_text("Before.\n" + line + "\nAfter.\n\nNext doc.\n")
    started = time.perf_counter()
    docs = list(read_documents([f]))
    assert time.perf_counter() - started < 30
    # The long document comes in parts of at most MAX_DOCUMENT_SENTENCES sentences, in order.
    assert docs[-1] == ["Next doc."] and all(len(d) <= MAX_DOCUMENT_SENTENCES for d in docs)
    first = [s for d in docs[:-1] for s in d]
    assert first[0] == "Before." and first[-1] == "After."
    assert max(len(s) for s in first) <= MAX_SENTENCE_CHARS
    # Nothing lost but whitespace, even where a sentence straddles two read pieces, and no two words
    # glued together where a piece ended in a space.
    assert sum(len(s.replace(" ", "")) for s in first[1:-1]) == len(line.replace(" ", ""))
    if " " in line:
        assert " ".join(first[1:-1]).split() == line.split()


def test_gzip_compressed_files_read_as_their_plain_text(tmp_path):
    """.txt.gz and .jsonl.gz, named or in a folder (where they were left out without a word), read as the
    same text uncompressed; a damaged one is refused in one line naming it."""
    import gzip
    text = "One. Two.\n\nThree.\n"
    jsonl = json.dumps({"text": "Four. Five."}) + "\n"
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.txt").write_text(text)
    (tmp_path / "data" / "b.TXT.GZ").write_bytes(gzip.compress(text.encode()))
    (tmp_path / "data" / "c.jsonl.gz").write_bytes(gzip.compress(jsonl.encode()))
    (tmp_path / "data" / "d.tar.gz").write_bytes(gzip.compress(b"x"))
    files = resolve_corpus_files([str(tmp_path / "data")])
    assert [f.name for f in files] == ["a.txt", "b.TXT.GZ", "c.jsonl.gz"]
    assert list(read_documents(files)) == [["One.", "Two."], ["Three."]] * 2 + [["Four.", "Five."]]
    with pytest.raises(CorpusError, match="neither .txt nor .jsonl"):
        resolve_corpus_files([str(tmp_path / "data" / "d.tar.gz")])
    (tmp_path / "cut.txt.gz").write_bytes(gzip.compress(text.encode() * 100)[:40])
    (tmp_path / "plain.txt.gz").write_text(text)
    for name, reason in (("cut.txt.gz", "Compressed file ended before"), ("plain.txt.gz", "Not a gzipped file")):
        with pytest.raises(CorpusError, match=f"cannot read corpus file .*{name}: {reason}"):
            list(read_documents([tmp_path / name]))


def test_a_corpus_file_gone_while_data_is_prepared_is_one_line(tmp_path, monkeypatch):
    """Removed (or made unreadable) between the tokenizer's pass and the shards': a FileNotFoundError
    traceback, exit 1, before; now the refusal names the file."""
    import training.data as data_module
    gone = tmp_path / "b.txt"
    gone.write_text("One more. Document here.\n")
    corpus = write_txt_corpus(tmp_path / "a.txt", n_docs=30, sentences=(2, 4), words=(3, 8))
    train = data_module.train_wordpiece

    def train_then_remove(*args):
        tokenizer = train(*args)
        gone.unlink()
        return tokenizer

    monkeypatch.setattr(data_module, "train_wordpiece", train_then_remove)
    with pytest.raises(CorpusError, match=f"^cannot read corpus file {gone}: No such file or directory$"):
        prepare_data(DataConfig(corpus=(str(corpus), str(gone)), vocab_size=200, cache_dir=str(tmp_path / "cache")),
                     show_progress=False)
    assert not list((tmp_path / "cache").iterdir())


def test_resolve_files_folders_and_globs(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    for name in ("a/1.txt", "a/b/2.jsonl", "a/b/3.csv", "a/b/4.TXT", "c.txt", "D.Txt"):
        (tmp_path / name).write_text("x")
    files = resolve_corpus_files([str(tmp_path / "a"), str(tmp_path / "*.txt"), str(tmp_path / "c.txt"),
                                  str(tmp_path / "D.Txt")])  # suffixes in any case, as Windows tools write them
    assert [f.relative_to(tmp_path.resolve()).as_posix() for f in files] == ["a/1.txt", "a/b/2.jsonl", "a/b/4.TXT",
                                                                          "c.txt", "D.Txt"]


def test_a_folder_names_the_files_its_glob_does(tmp_path):
    """`--corpus data` and `--corpus 'data/**'` name the same files in the same order: hidden files and
    folders (an editor's backups, .ipynb_checkpoints) are left out of both, as a shell's glob leaves them."""
    for name in ("data/b.txt", "data/A.txt", "data/sub/c.jsonl", "data/sub-x/d.txt", "data/.backup.txt",
                 "data/.ipynb_checkpoints/b-checkpoint.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    folder = resolve_corpus_files([str(tmp_path / "data")])
    assert [f.relative_to(tmp_path.resolve()).as_posix() for f in folder] == ["data/A.txt", "data/b.txt",
                                                                           "data/sub/c.jsonl", "data/sub-x/d.txt"]
    assert resolve_corpus_files([str(tmp_path / "data/**")]) == folder
    assert resolve_corpus_files([str(tmp_path / "data") + "/"]) == folder


def test_corpus_files_compressed_otherwise_than_gzip_in_a_folder_are_warned_of(tmp_path, caplog):
    """A folder of .txt.zst (or .bz2, .xz) files beside .txt ones: those are left out, as before, but said
    in one warning naming one of them, not dropped without a word; a folder without them warns nothing."""
    for name in ("data/a.txt", "data/b.txt.zst", "data/sub/c.jsonl.bz2", "data/d.csv.xz", "plain/e.txt"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    with caplog.at_level(logging.WARNING):
        files = resolve_corpus_files([str(tmp_path / "data"), str(tmp_path / "plain")])
    assert [f.name for f in files] == ["a.txt", "e.txt"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [f"{tmp_path / 'data'}: left out 2 corpus files compressed other than with gzip (e.g. "
                        f"b.txt.zst); decompress them, or recompress them with gzip (.gz)"]


def test_a_jsonl_line_nested_past_pythons_depth_is_a_bad_line(tmp_path, caplog):
    """json.loads raises RecursionError, not ValueError, for a line nested deeper than Python recurses: one
    more bad line, not a traceback that stops data preparation."""
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"text": "One. Two."}) + "\n" + "[" * 200_000 + "\n" + json.dumps({"text": "Three."})
                 + "\n", encoding="utf-8")
    stats = CorpusStats()
    with caplog.at_level(logging.WARNING):
        docs = list(read_documents([f], stats))
    assert docs == [["One.", "Two."], ["Three."]] and stats.bad_jsonl_lines == 1


@pytest.mark.timeout(10)
def test_a_folder_with_links_to_folders_above_is_read_once_and_at_once(tmp_path):
    """Two links back up the tree (`latest -> .`, `up -> ..`): glob's `**` went round them 2^40 times."""
    (tmp_path / "data" / "sub").mkdir(parents=True)
    (tmp_path / "data" / "a.txt").write_text("x")
    (tmp_path / "data" / "sub" / "b.txt").write_text("x")
    (tmp_path / "data" / "latest").symlink_to(".", target_is_directory=True)
    (tmp_path / "data" / "sub" / "up").symlink_to("..", target_is_directory=True)
    for corpus in ("data", "data/**", "data/**/*.txt"):
        files = resolve_corpus_files([str(tmp_path / corpus)])
        assert [f.relative_to(tmp_path.resolve()).as_posix() for f in files] == ["data/a.txt", "data/sub/b.txt"]


@pytest.mark.parametrize("case, message", [
    ("missing", "does not exist"), ("empty_folder", "no .txt or .jsonl files"),
    ("wrong_suffix", "neither .txt nor .jsonl"), ("glob_no_match", "no .txt or .jsonl files"),
])
def test_bad_corpus_paths_raise_corpus_error(tmp_path, case, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "data.csv").write_text("a,b\n")
    path = {"missing": tmp_path / "nope.txt", "empty_folder": tmp_path / "empty",
            "wrong_suffix": tmp_path / "data.csv", "glob_no_match": tmp_path / "zz*.txt"}[case]
    with pytest.raises(CorpusError, match=message):
        prepare_data(DataConfig(corpus=(str(path),), vocab_size=200, cache_dir=str(tmp_path / "cache")),
                     show_progress=False)


@pytest.mark.parametrize("content, message", [
    ("", "has 0 document"), ("\n\n   \n", "has 0 document"),
    ("Only one document.\nWith two lines.\n", "has 1 document"),
    ("Doc one.\n\nDoc two.\n\nDoc three.\n", "too few to hold out"),
])
def test_too_small_corpora_raise_corpus_error(tmp_path, content, message):
    f = tmp_path / "c.txt"
    f.write_text(content)
    cfg = DataConfig(corpus=(str(f),), vocab_size=200, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(CorpusError, match=message) as err:
        prepare_data(cfg, show_progress=False)
    assert "\n" not in str(err.value)
    assert not list((tmp_path / "cache").glob("data-*"))  # nothing half-built left behind


def test_corpus_error_is_a_value_error():
    assert issubclass(CorpusError, ValueError)


# --- docstring corpus -----------------------------------------------------------------------------

_PACKAGE = '''"""A small module that explains several things. It has sentences the corpus should keep.

Example::

    x = compute(3)
    print(x)

>>> compute(2)
4
>>> for i in range(2):
...     print(i)
0
1

See :func:`compute` and :class:`~pkg.mod.Thing` for ``details``, or `the docs <http://x.org>`_.
"""
import pathlib
pathlib.Path(__file__).with_name("IMPORTED").write_text("yes")
raise RuntimeError("this module must never be imported")


def compute(x):
    """Compute the square of a number and hand it back to the caller at once.

    Parameters
    ----------
    x : int
        The number.

    .. code-block:: python

        compute(1)

    .. note:: This is **important** and *useful* for everybody reading it today.
    """


class Thing:
    """Too short to keep."""

    def method(self):
        """Compute the square of a number and hand it back to the caller at once.

        Parameters
        ----------
        x : int
            The number.

        .. code-block:: python

            compute(1)

        .. note:: This is **important** and *useful* for everybody reading it today.
        """

    if True:
        def nested(self):
            """A docstring inside an if block is still found by the statement walk, all of it."""
'''


def _docstring_docs(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_docstring_corpus_drops_examples_and_markup_and_never_imports(tmp_path):
    pkg = tmp_path / "site" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "mod.py").write_text(_PACKAGE)
    (pkg / "broken.py").write_text('"""Syntax error below, the file is skipped quietly."""\ndef (:\n')
    out = dc.docstring_corpus(tmp_path / "cache", roots=[tmp_path / "site"], show_progress=False, workers=1)
    docs = _docstring_docs(out)
    texts = [d["text"] for d in docs]
    assert not (pkg / "IMPORTED").exists() and "pkg.mod" not in sys.modules and "mod" not in sys.modules
    assert texts[0] == ("A small module that explains several things. It has sentences the corpus should keep.\n"
                        "Example:\n"
                        "See compute and pkg.mod.Thing for details, or the docs.")
    assert ("Compute the square of a number and hand it back to the caller at once.\n"
            "x : int The number.\n"
            "This is important and useful for everybody reading it today.") in texts
    assert len(texts) == 3  # method's docstring equals compute's (deduplicated); Thing's is too short
    assert any(d["source"].endswith("mod.py:Thing.nested") for d in docs)
    joined = "\n".join(texts)
    for noise in (">>>", "...", "print(", "compute(1)", "0\n1", "----", "::", "``", ":func:", "http"):
        assert noise not in joined


def test_docstring_corpus_is_cached_and_rebuilt_when_a_file_changes(tmp_path, monkeypatch):
    pkg = tmp_path / "site" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "a.py").write_text('"""One module docstring that is long enough to be kept in the corpus."""\n')
    first = dc.docstring_corpus(tmp_path / "cache", roots=[tmp_path / "site"], show_progress=False, workers=1)
    with monkeypatch.context() as m:
        m.setattr(dc, "file_documents", lambda p: pytest.fail("re-extracted a cached corpus"))
        assert dc.docstring_corpus(tmp_path / "cache", roots=[tmp_path / "site"], show_progress=False) == first
    (pkg / "b.py").write_text('"""Another module docstring that is long enough to be kept, as well."""\n')
    second = dc.docstring_corpus(tmp_path / "cache", roots=[tmp_path / "site"], show_progress=False, workers=1)
    assert second != first and len(_docstring_docs(second)) == 2


def test_docstring_corpus_on_a_slice_of_the_stdlib(tmp_path):
    """Real docstrings (json, the same in parallel workers), in sorted-file order, no doctests."""
    roots = [Path(sysconfig.get_paths()["stdlib"]) / "json"]
    serial = dc.docstring_corpus(tmp_path / "one", roots=roots, show_progress=False, workers=1)
    parallel = dc.docstring_corpus(tmp_path / "two", roots=roots, show_progress=False, workers=2)
    assert serial.read_bytes() == parallel.read_bytes()
    docs = _docstring_docs(serial)
    assert len(docs) >= 10
    assert all(len(d["text"].split()) >= dc.MIN_WORDS and ">>>" not in d["text"] for d in docs)
    sources = [d["source"].split(":")[0] for d in docs]
    assert sources == sorted(sources)


def test_empty_corpus_config_uses_the_docstring_corpus(tmp_path, monkeypatch):
    pkg = tmp_path / "site"
    pkg.mkdir()
    for i in range(6):
        (pkg / f"m{i}.py").write_text(
            f'"""Module number {i} explains how its functions work. It has two sentences."""\n\n'
            f'def f():\n    """Function {i} returns nothing at all, but its docstring is long enough."""\n')
    monkeypatch.setattr(dc, "default_source_roots", lambda: [pkg])
    data = prepare_data(DataConfig(vocab_size=150, cache_dir=str(tmp_path / "cache"), heldout_fraction=0.1),
                        show_progress=False)
    assert data.stats["documents"] == 12 and data.stats["corpus"].startswith("python docstrings")
    assert data.train.num_examples(0) > 0


_PEAK_RSS_OF_PREPARING = """
import resource, sys
from training.data import DataConfig, prepare_data
data = prepare_data(DataConfig(corpus=(sys.argv[1],), cache_dir=sys.argv[2], vocab_size=2000), show_progress=False)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, data.train.shards.n_tokens + data.heldout.shards.n_tokens)
"""


@pytest.mark.slow
def test_a_huge_line_costs_memory_like_a_small_document(tmp_path):
    """Preparing a corpus with a 16 MB one-line document takes less than twice the line's size in memory
    above the same corpus without it (it took 35 times before: one document of 16k sentences, all their
    Encoding objects at once), and every sentence of the line is in the data."""
    import random
    import subprocess

    from tests.data_corpora import sentence

    rng = random.Random(0)
    normal = "".join("\n".join(sentence(rng, 6, 20) for _ in range(rng.randint(3, 30))) + "\n\n" for _ in range(400))
    line = []
    while sum(map(len, line)) < 16 << 20:
        line.append(" ".join(sentence(rng, 6, 20) for _ in range(1000)) + " ")
    line = "".join(line)
    (tmp_path / "base.txt").write_text(normal)
    (tmp_path / "huge.txt").write_text(normal + line + "\n\n")

    def prepare(name: str) -> tuple[int, int]:
        out = subprocess.run([sys.executable, "-c", _PEAK_RSS_OF_PREPARING, str(tmp_path / name), str(tmp_path / name[:4])],
                             capture_output=True, text=True, timeout=600, check=True, cwd=Path(__file__).parents[1])
        peak, tokens = out.stdout.split()
        return int(peak), int(tokens)

    (base_peak, base_tokens), (huge_peak, huge_tokens) = prepare("base.txt"), prepare("huge.txt")
    assert huge_peak - base_peak < 2 * len(line), (base_peak >> 20, huge_peak >> 20)
    assert huge_tokens - base_tokens > len(line.split()) * 0.9  # the line's words, in word pieces
