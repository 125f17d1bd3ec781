"""DistilBERT checkpoints, read as BERT (training/distilbert.py): encoders served as transformers and
sentence-transformers compute them, classifiers scored as transformers scores them, the MLM head kept
for continued pretraining (tests/test_init_from.py), and what the server cannot reproduce refused in
one line."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer

from export.pipeline import export_artifact
from tests.hf_checkpoints import saved_model, sentence_transformer_exported, vocab_size
from tests.test_app import assert_error, run, serving
from training.model_folder import ModelFolderError, load_model_folder

SHAPES = ((1, 5), (3, 40))
TEXTS = ["The quick brown fox jumps over the lazy dog.", "short", "naïve café, and a rather longer sentence " * 3]


def distilbert_folder(root, tokenizer_dir, model_class=transformers.DistilBertModel, seed=2, **config):
    """A tiny random transformers DistilBERT with the test tokenizer, saved by transformers."""
    return saved_model(root, tokenizer_dir, model_class, transformers.DistilBertConfig(
        vocab_size=vocab_size(tokenizer_dir), dim=32, n_layers=2, n_heads=4, hidden_dim=64,
        max_position_embeddings=64, **config), seed)


def test_a_distilbert_encoder_is_served_as_transformers_computes_it(tiny_tokenizer_dir, tmp_path):
    folder, model = distilbert_folder(tmp_path / "hf", tiny_tokenizer_dir)
    m = export_artifact(folder, tmp_path / "art", parity_shapes=SHAPES)
    assert not m.has_pooler and not m.has_nsp_head and m.default_pooling == "cls"
    tok = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))

    async def go():
        async with serving(tmp_path / "art") as (c, _):
            return ((await c.post("/embed", json={"inputs": TEXTS, "return_tokens": True, "pooling": "mean"})).json(),
                    (await c.post("/embed", json={"inputs": [["a question", "its answer"]]})).json(),
                    await c.post("/nsp", json={"pairs": [["a", "b"]]}))
    embed, pair, nsp = run(go())
    for text, row in zip(TEXTS, embed["data"]):
        with torch.no_grad():
            want = model(input_ids=torch.tensor([tok.encode(text).ids])).last_hidden_state[0].numpy()
        np.testing.assert_allclose(row["token_embeddings"], want, atol=1e-5)
        np.testing.assert_allclose(row["embedding"], want.mean(0), atol=1e-5)
    # DistilBERT has no segments: a pair's second text embeds as in one sequence
    with torch.no_grad():
        want = model(input_ids=torch.tensor([tok.encode("a question", "its answer").ids])).last_hidden_state[0, 0]
    np.testing.assert_allclose(pair["data"][0]["embedding"], want.numpy(), atol=1e-5)
    assert_error(nsp, 400, "unsupported", "next-sentence")


def test_a_sentence_transformers_distilbert_model_is_served_as_it_encodes(tiny_tokenizer_dir, tmp_path):
    st = pytest.importorskip("sentence_transformers")
    folder, _ = distilbert_folder(tmp_path / "hf", tiny_tokenizer_dir)
    want = sentence_transformer_exported(st, folder, tmp_path, TEXTS, SHAPES)

    async def go():
        async with serving(tmp_path / "art") as (c, _):
            return (await c.post("/v1/embeddings", json={"input": TEXTS})).json()
    np.testing.assert_allclose([d["embedding"] for d in run(go())["data"]], want, atol=2e-5)


def test_a_distilbert_masked_lm_keeps_its_mlm_head(tiny_tokenizer_dir, tmp_path):
    """--init-from reads DistilBertForMaskedLM's head as BERT's: the same MLM logits as transformers'."""
    folder, model = distilbert_folder(tmp_path / "hf", tiny_tokenizer_dir, transformers.DistilBertForMaskedLM)
    loaded = load_model_folder(folder)
    assert loaded.has_mlm_head and not loaded.has_pooler and not loaded.has_nsp_head
    assert loaded.model.cls.predictions.decoder.weight is loaded.model.bert.embeddings.word_embeddings.weight
    ids = torch.tensor([Tokenizer.from_file(str(folder / "tokenizer.json")).encode(TEXTS[0]).ids])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = loaded.model(ids, torch.zeros_like(ids), torch.ones_like(ids)).mlm_logits
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=1e-4)


@pytest.mark.parametrize("labels", [1, 3])
def test_a_distilbert_classifier_scores_as_transformers_does(labels, tiny_tokenizer_dir, tmp_path):
    """DistilBertForSequenceClassification (relu(pre_classifier([CLS])), then classifier): a cross-encoder
    (one label) on /rerank, a classifier on /predict, each within 1e-5 of transformers' own scores."""
    folder, model = distilbert_folder(tmp_path / "hf", tiny_tokenizer_dir,
                                      transformers.DistilBertForSequenceClassification, num_labels=labels,
                                      initializer_range=0.3)  # scores spread, so that the order is tested
    m = export_artifact(folder, tmp_path / "art", parity_shapes=SHAPES)
    assert len(m.classifier_labels) == labels
    tok = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))
    pairs = [("how do cats sleep", text) for text in TEXTS]
    with torch.no_grad():
        logits = np.array([model(input_ids=torch.tensor([tok.encode(*pair).ids])).logits[0].numpy()
                           for pair in pairs], dtype=np.float64)

    async def go():
        async with serving(tmp_path / "art") as (c, _):
            if labels == 1:
                return (await c.post("/rerank", json={"query": pairs[0][0], "texts": TEXTS})).json()
            return (await c.post("/predict", json={"inputs": [list(pair) for pair in pairs]})).json()
    answer = run(go())
    if labels == 1:
        np.testing.assert_allclose([r["score"] for r in sorted(answer, key=lambda r: r["index"])],
                                   1 / (1 + np.exp(-logits[:, 0])), atol=1e-5)
    else:
        want = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
        got = [[next(p["score"] for p in row if p["label"] == f"LABEL_{k}") for k in range(labels)] for row in answer]
        np.testing.assert_allclose(got, want, atol=1e-5)


def test_continued_pretraining_refuses_a_distilbert_classifier_naming_what_it_would_lose(tiny_tokenizer_dir,
                                                                                         tmp_path):
    folder, _ = distilbert_folder(tmp_path / "hf", tiny_tokenizer_dir, transformers.DistilBertForSequenceClassification)
    with pytest.raises(ModelFolderError, match="DistilBertForSequenceClassification.*pretraining would drop"):
        load_model_folder(folder)  # as --init-from reads it


def test_a_distilbert_of_another_activation_is_one_line(tiny_tokenizer_dir, tmp_path):
    folder, _ = distilbert_folder(tmp_path / "hf", tiny_tokenizer_dir, activation="relu")
    with pytest.raises(ModelFolderError, match="unsupported hidden_act 'relu'"):
        load_model_folder(folder)
    with pytest.raises(Exception, match="unsupported hidden_act 'relu'"):
        export_artifact(folder, tmp_path / "art", parity_shapes=SHAPES)
    assert not (tmp_path / "art").exists()
