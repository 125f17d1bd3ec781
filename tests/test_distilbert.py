"""DistilBERT checkpoints, read as BERT (training/distilbert.py): served as transformers and
sentence-transformers compute them, continued-pretrained from their own MLM head, and their task heads
and unsupported variants refused in one line."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer

from export.pipeline import export_artifact
from tests.test_app import assert_error, run, serving
from training.model_folder import ModelFolderError, load_model_folder

SHAPES = ((1, 5), (3, 40))
TEXTS = ["The quick brown fox jumps over the lazy dog.", "short", "naïve café, and a rather longer sentence " * 3]


def distilbert_folder(root, tokenizer_dir, model_class=transformers.DistilBertModel, seed=2, **config):
    """A tiny random transformers DistilBERT with the test tokenizer, saved by transformers."""
    torch.manual_seed(seed)
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    cfg = transformers.DistilBertConfig(vocab_size=len(vocab), dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                                        max_position_embeddings=64, **config)
    model = model_class(cfg).eval()
    model.save_pretrained(root)
    shutil.copy(tokenizer_dir / "tokenizer.json", root / "tokenizer.json")
    return root, model


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
    from sentence_transformers.models import Normalize, Pooling, Transformer

    folder, _ = distilbert_folder(tmp_path / "hf", tiny_tokenizer_dir)
    model = st.SentenceTransformer(modules=[Transformer(str(folder), max_seq_length=24), Pooling(32, "mean"),
                                            Normalize()], device="cpu")
    model.save(str(tmp_path / "model"))
    m = export_artifact(tmp_path / "model", tmp_path / "art", parity_shapes=SHAPES)
    assert (m.default_pooling, m.default_normalize, m.max_length) == ("mean", True, 24)
    want = st.SentenceTransformer(str(tmp_path / "model"), device="cpu").encode(TEXTS, convert_to_numpy=True)

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


@pytest.mark.parametrize("case,words", [
    ("classifier", "DistilBertForSequenceClassification: its weights hold a task head"),
    ("relu", "unsupported hidden_act 'relu'"),
])
def test_distilbert_variants_the_server_cannot_reproduce_are_one_line(case, words, tiny_tokenizer_dir, tmp_path):
    if case == "classifier":
        folder, _ = distilbert_folder(tmp_path / "hf", tiny_tokenizer_dir,
                                      transformers.DistilBertForSequenceClassification)
    else:
        folder, _ = distilbert_folder(tmp_path / "hf", tiny_tokenizer_dir, activation="relu")
    with pytest.raises(ModelFolderError, match=words):
        load_model_folder(folder, sequence_classifier=True)
    with pytest.raises(Exception, match=words):
        export_artifact(folder, tmp_path / "art", parity_shapes=SHAPES)
    assert not (tmp_path / "art").exists()

