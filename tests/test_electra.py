"""ELECTRA checkpoints, read as BERT (training/electra.py): the discriminator served as transformers
computes it, a cross-encoder (ElectraForSequenceClassification, as ms-marco-electra-base) scored as
transformers and sentence-transformers' CrossEncoder score it, and ELECTRA-small's narrower embeddings
refused in one line."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer

from export.pipeline import export_artifact
from tests.hf_checkpoints import saved_model, vocab_size
from tests.test_app import run, serving
from training.model_folder import ModelFolderError, load_model_folder

SHAPES = ((1, 5), (3, 40))
QUERY = "how do cats sleep"
TEXTS = ["Cats sleep for most of the day, curled up somewhere warm.", "The stock market fell on Monday.",
         "naïve café, and a rather longer sentence " * 3]


def electra_folder(root, tokenizer_dir, model_class=transformers.ElectraModel, seed=3, **config):
    """A tiny random transformers ELECTRA with the test tokenizer, saved by transformers."""
    return saved_model(root, tokenizer_dir, model_class, transformers.ElectraConfig(**{
        "vocab_size": vocab_size(tokenizer_dir), "embedding_size": 32, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "intermediate_size": 64, "max_position_embeddings": 64, **config}), seed)


@pytest.mark.parametrize("model_class", [transformers.ElectraModel, transformers.ElectraForPreTraining])
def test_an_electra_discriminator_is_served_as_transformers_computes_it(model_class, tiny_tokenizer_dir, tmp_path):
    """ElectraForPreTraining is how google/electra-*-discriminator ship: its replaced-token head is left out."""
    folder, model = electra_folder(tmp_path / "hf", tiny_tokenizer_dir, model_class)
    model = getattr(model, "electra", model)
    m = export_artifact(folder, tmp_path / "art", parity_shapes=SHAPES)
    assert not m.has_pooler and not m.has_nsp_head
    tok = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))

    async def go():
        async with serving(tmp_path / "art") as (c, _):
            return (await c.post("/embed", json={"inputs": TEXTS + [[QUERY, TEXTS[0]]], "return_tokens": True})).json()
    rows = run(go())["data"]
    for item, row in zip(TEXTS + [(QUERY, TEXTS[0])], rows):
        enc = tok.encode(*item) if isinstance(item, tuple) else tok.encode(item)
        with torch.no_grad():
            want = model(input_ids=torch.tensor([enc.ids]), token_type_ids=torch.tensor([enc.type_ids])
                         ).last_hidden_state[0].numpy()
        np.testing.assert_allclose(row["token_embeddings"], want, atol=1e-5)


def test_an_electra_cross_encoder_reranks_as_sentence_transformers_predicts(tiny_tokenizer_dir, tmp_path):
    st = pytest.importorskip("sentence_transformers")
    folder, model = electra_folder(tmp_path / "hf", tiny_tokenizer_dir, transformers.ElectraForSequenceClassification,
                                   num_labels=1, initializer_range=0.3)
    m = export_artifact(folder, tmp_path / "art", parity_shapes=SHAPES)
    assert m.classifier_labels == ["LABEL_0"]
    want = st.CrossEncoder(str(folder), device="cpu").predict([(QUERY, t) for t in TEXTS])  # sigmoid of the logit
    tok = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))
    with torch.no_grad():
        logits = [model(input_ids=torch.tensor([e.ids]), token_type_ids=torch.tensor([e.type_ids])).logits[0, 0].item()
                  for e in (tok.encode(QUERY, t) for t in TEXTS)]
    np.testing.assert_allclose(want, 1 / (1 + np.exp(-np.array(logits))), atol=1e-5)

    async def go():
        async with serving(tmp_path / "art") as (c, _):
            return (await c.post("/rerank", json={"query": QUERY, "texts": TEXTS})).json()
    ranks = run(go())
    np.testing.assert_allclose([r["score"] for r in sorted(ranks, key=lambda r: r["index"])], want, atol=1e-5)
    assert [r["index"] for r in ranks] == np.argsort(-want, kind="stable").tolist()


def test_electra_small_embeddings_are_one_line(tiny_tokenizer_dir, tmp_path):
    folder, _ = electra_folder(tmp_path / "hf", tiny_tokenizer_dir, embedding_size=16)
    with pytest.raises(ModelFolderError, match="embedding_size 16 differs from hidden_size 32"):
        load_model_folder(folder)
    with pytest.raises(Exception, match="embedding_size 16 differs from hidden_size 32"):
        export_artifact(folder, tmp_path / "art", parity_shapes=SHAPES)
    assert not (tmp_path / "art").exists()
