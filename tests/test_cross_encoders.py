"""Fine-tuned sequence classifiers as their users call them: a cross-encoder (one label) exported from a
transformers BertForSequenceClassification folder or a sentence-transformers CrossEncoder folder scores
[query, text] pairs on /rerank as CrossEncoder.predict does; a classifier of several labels answers /predict
with transformers' softmax. Both in one process and through HTTP workers."""
from __future__ import annotations

import json
import shutil

import httpx
import numpy as np
import pytest
import torch

from export.pipeline import export_artifact
from tests.hf_checkpoints import saved_model, vocab_size
from tests.test_app import assert_error, run, serving
from tests.test_server import running_server
from training.model_folder import ModelFolderError, load_model_folder

SHAPES = ((1, 5), (3, 40))
QUERY = "how do cats sleep"
TEXTS = ["Cats sleep for most of the day, curled up somewhere warm.", "The stock market fell on Monday.",
         "a cat", "Überraschung: naïve café résumé and emoji 🚀 " * 3]
LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def classifier_folder(root, tokenizer_dir, num_labels: int, seed: int):
    """A tiny transformers BertForSequenceClassification (random, initialised wide so that scores spread)."""
    import transformers

    config = transformers.BertConfig(vocab_size=vocab_size(tokenizer_dir), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                                     num_labels=num_labels, initializer_range=0.3,  # inputs then differ
                                     **({"id2label": LABELS} if num_labels == 3 else {}))
    return saved_model(root, tokenizer_dir, transformers.BertForSequenceClassification, config, seed)


def logits_of(model, tokenizer_dir, items) -> np.ndarray:
    """transformers' own logits for texts or pairs, one at a time (no padding)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    rows = []
    for item in items:
        enc = tok.encode(*item) if isinstance(item, tuple) else tok.encode(item)
        with torch.no_grad():
            out = model(input_ids=torch.tensor([enc.ids]), token_type_ids=torch.tensor([enc.type_ids]),
                        attention_mask=torch.ones(1, len(enc.ids), dtype=torch.long))
        rows.append(out.logits[0].numpy())
    return np.array(rows, dtype=np.float64)


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory, tiny_tokenizer_dir):
    root = tmp_path_factory.mktemp("ce")
    folder, model = classifier_folder(root / "hf", tiny_tokenizer_dir, 1, seed=3)
    return folder, model


@pytest.mark.parametrize("saved_by", ["transformers", "sentence-transformers"])
def test_a_cross_encoder_reranks_as_sentence_transformers_predicts(cross_encoder, tiny_tokenizer_dir, tmp_path,
                                                                     saved_by):
    st = pytest.importorskip("sentence_transformers")
    folder, model = cross_encoder
    if saved_by == "sentence-transformers":  # modules.json, config_sentence_transformers.json (CrossEncoder)
        st.CrossEncoder(str(folder), device="cpu").save(str(tmp_path / "st"))
        folder = tmp_path / "st"
    m = export_artifact(folder, tmp_path / "art", parity_shapes=SHAPES)
    assert m.classifier_labels == ["LABEL_0"] and not m.has_nsp_head
    for graph in m.graphs.values():
        assert "classifier_logits" in graph.outputs
    assert m.graphs["fp32"].parity["classifier_logits_max_abs"] <= 1e-4
    pairs = [(QUERY, t) for t in TEXTS]
    want = st.CrossEncoder(str(folder), device="cpu").predict(pairs)  # sigmoid of the logit
    logits = logits_of(model, tiny_tokenizer_dir, pairs)[:, 0]
    np.testing.assert_allclose(want, 1 / (1 + np.exp(-logits)), atol=1e-5)

    async def go():
        async with serving(tmp_path / "art") as (c, _):
            return ((await c.post("/rerank", json={"query": QUERY, "texts": TEXTS, "return_text": True})).json(),
                    (await c.post("/rerank", json={"query": QUERY, "texts": TEXTS, "raw_scores": True})).json(),
                    (await c.post("/predict", json={"inputs": [QUERY, TEXTS[0]]})).json(),
                    (await c.get("/info")).json(),
                    await c.post("/rerank", json={"query": QUERY, "texts": ["word " * 200], "truncate": False}),
                    await c.post("/rerank", json={"query": "word " * 200, "texts": TEXTS[:2], "truncate": False}),
                    await c.post("/rerank", json={"query": QUERY, "texts": []}),
                    await c.post("/nsp", json={"pairs": [[QUERY, TEXTS[0]]]}),
                    await c.post("/rerank", json={"query": "", "texts": TEXTS}),
                    await c.post("/v1/rerank", json={"query": QUERY, "documents": ["a", ""]}),
                    await c.post("/rerank", json={"query": QUERY, "texts": TEXTS, "documents": TEXTS[:1]}))
    ranks, raw, predicted, info, too_long, long_query, empty, nsp, no_query, empty_document, both = run(go())
    assert_error(both, 422, "invalid_request", "`texts`", "`documents`", "not both")
    # each text's own score, most relevant first: the ranking, whatever the random model's scores are
    assert sorted(r["index"] for r in ranks) == list(range(len(TEXTS)))
    np.testing.assert_allclose([r["score"] for r in ranks], want[[r["index"] for r in ranks]], atol=1e-5)
    assert all(a["score"] >= b["score"] for a, b in zip(ranks, ranks[1:]))
    assert [r["text"] for r in ranks] == [TEXTS[r["index"]] for r in ranks]
    np.testing.assert_allclose([r["score"] for r in sorted(raw, key=lambda r: r["index"])], logits, atol=1e-4)
    assert "text" not in raw[0]
    assert predicted == [{"score": pytest.approx(float(want[0]), abs=1e-5), "label": "LABEL_0"}]
    assert info["classifier_labels"] == ["LABEL_0"]
    assert_error(too_long, 413, "input_too_long", "[query, texts[0]] has")
    assert_error(long_query, 413, "input_too_long", "[query, texts[0]] has")  # not the text alone: the query
    assert_error(empty, 422, "invalid_request", "empty")
    assert_error(nsp, 400, "unsupported", "next-sentence")
    assert_error(no_query, 422, "invalid_request", "query is an empty string")
    assert_error(empty_document, 422, "invalid_request", "documents[1] is an empty string")



def test_a_tokenizer_that_truncates_on_the_left_cuts_pairs_there_as_cross_encoder_predict_does(cross_encoder, tmp_path):
    """transformers' tokenizer, and so CrossEncoder.predict, cuts over-long pairs at tokenizer_config.json's
    truncation_side: the server cuts there too unless a request names a direction (it cut on the right)."""
    st = pytest.importorskip("sentence_transformers")
    folder, _ = cross_encoder
    shutil.copytree(folder, tmp_path / "left")
    (tmp_path / "left" / "tokenizer_config.json").write_text(json.dumps({"truncation_side": "left",
                                                                         "model_max_length": 24}))
    m = export_artifact(tmp_path / "left", tmp_path / "art", parity_shapes=SHAPES)
    assert (m.truncation_direction, m.max_length) == ("left", 24)
    texts = [text * 4 for text in TEXTS]  # each past 24 tokens with the query
    model = st.CrossEncoder(str(tmp_path / "left"), device="cpu")
    want = model.predict([(QUERY, t) for t in texts])
    want_ids = model.tokenizer(QUERY, texts[0], truncation=True)
    model.tokenizer.truncation_side = "right"
    right = model.predict([(QUERY, t) for t in texts])
    assert np.abs(want - right).max() > 1e-3  # the two ends give other scores

    async def go():
        async with serving(tmp_path / "art") as (c, _):
            return ((await c.post("/rerank", json={"query": QUERY, "texts": texts})).json(),
                    (await c.post("/rerank", json={"query": QUERY, "texts": texts,
                                                   "truncation_direction": "Right"})).json(),
                    (await c.post("/v1/rerank", json={"query": QUERY, "documents": texts})).json(),
                    (await c.post("/tokenize", json={"inputs": [[QUERY, texts[0]]]})).json(),
                    (await c.get("/info")).json())
    ranks, right_ranks, documents, tokenized, info = run(go())
    np.testing.assert_allclose([r["score"] for r in sorted(ranks, key=lambda r: r["index"])], want, atol=1e-5)
    np.testing.assert_allclose([r["relevance_score"] for r in sorted(documents["results"], key=lambda r: r["index"])],
                               want, atol=1e-5)
    np.testing.assert_allclose([r["score"] for r in sorted(right_ranks, key=lambda r: r["index"])], right, atol=1e-5)
    tokens = tokenized["data"][0]["tokens"]
    assert [t["id"] for t in tokens] == want_ids["input_ids"]
    assert [t["segment"] for t in tokens] == want_ids["token_type_ids"]
    assert info["truncation_direction"] == "left"


def test_a_classifier_predicts_every_label_with_transformers_softmax(tiny_tokenizer_dir, tmp_path):
    folder, model = classifier_folder(tmp_path / "hf", tiny_tokenizer_dir, 3, seed=5)
    m = export_artifact(folder, tmp_path / "art", parity_shapes=SHAPES)
    assert m.classifier_labels == ["negative", "neutral", "positive"]
    items = [TEXTS[0], (QUERY, TEXTS[1]), TEXTS[2]]
    logits = logits_of(model, tiny_tokenizer_dir, items)
    want = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)

    async def go():
        async with serving(tmp_path / "art") as (c, _):
            return ((await c.post("/predict", json={"inputs": TEXTS[0]})).json(),
                    (await c.post("/predict", json={"inputs": [[TEXTS[0]], [QUERY, TEXTS[1]], [TEXTS[2]]]})).json(),
                    (await c.post("/predict", json={"inputs": [QUERY, TEXTS[1]], "raw_scores": True})).json(),
                    await c.post("/rerank", json={"query": QUERY, "texts": TEXTS}),
                    await c.post("/predict", json={"inputs": [["a", "b", "c"]]}),
                    await c.post("/predict", json={"inputs": []}),
                    await c.post("/predict", json={"inputs": "still serving"}))
    one, batch, raw, rerank, three, empty, after = run(go())

    def as_rows(answer):  # [{"score", "label"}] highest first -> scores in label order
        assert [p["score"] for p in answer] == sorted((p["score"] for p in answer), reverse=True)
        return [next(p["score"] for p in answer if p["label"] == label) for label in LABELS.values()]
    np.testing.assert_allclose(as_rows(one), want[0], atol=1e-5)
    np.testing.assert_allclose([as_rows(a) for a in batch], want, atol=1e-5)
    np.testing.assert_allclose(as_rows(raw), logits[1], atol=1e-4)
    assert_error(rerank, 400, "unsupported", "3 labels")
    assert_error(three, 422, "invalid_request", "inputs")
    assert_error(empty, 422, "invalid_request", "inputs is empty")
    assert after.status_code == 200 and len(after.json()) == 3


@pytest.mark.gpu
def test_a_cross_encoder_scores_on_the_gpu_as_transformers_does(cross_encoder, tiny_tokenizer_dir, tmp_path):
    """The fp16 graph the GPU serves (packed, with our kernels when built) and its host-packed variant replayed
    as CUDA graphs give the classifier's scores within the export gate's 0.01."""
    from tokenizers import Tokenizer

    from app.engine import Batch, OrtEngine
    from artifact.manifest import CLASSIFIER_LOGITS
    from tests.feeds import padded_feed

    folder, model = cross_encoder
    m = export_artifact(folder, tmp_path / "art", device="cuda", parity_shapes=SHAPES)
    host_packed = m.graph("fp16").host_packed  # the classifier's logits replay as CUDA graphs too
    assert CLASSIFIER_LOGITS in m.graph("fp16").outputs and CLASSIFIER_LOGITS in host_packed.outputs
    items = [(QUERY, text) for text in TEXTS] * 3
    want = 1 / (1 + np.exp(-logits_of(model, tiny_tokenizer_dir, items)[:, 0]))
    tok = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))
    feed = padded_feed([tok.encode(*item) for item in items])
    batch = Batch(feed["input_ids"], feed["attention_mask"], feed["token_type_ids"], (CLASSIFIER_LOGITS,))
    for graphs in ("off", "on"):
        engine = OrtEngine(tmp_path / "art", m, "cuda", "fp16", cuda_graphs=graphs)
        assert engine.cuda_graphs == (graphs == "on")
        got = 1 / (1 + np.exp(-engine.run(batch)[CLASSIFIER_LOGITS][:, 0]))
        np.testing.assert_allclose(got, want, atol=0.01, err_msg=f"cuda_graphs {graphs}")


def test_an_encoder_has_no_classifier_routes(tiny_artifact_dir):
    async def go():
        async with serving(tiny_artifact_dir) as (c, _):
            return (await c.post("/rerank", json={"query": "q", "texts": ["t"]}),
                    await c.post("/predict", json={"inputs": "t"}), (await c.get("/info")).json(),
                    await c.post("/v2/rerank", json={"query": "q", "documents": ["t"]}))
    rerank, predict, info, documents = run(go())
    for r in (rerank, predict, documents):
        assert_error(r, 400, "unsupported", "no sequence-classification head")
    assert info["classifier_labels"] == []


def test_rerank_through_http_workers(cross_encoder, tiny_tokenizer_dir, tmp_path):
    """The engine process answers the classifier's output to the HTTP workers (the link names it). POST /
    and /invocations rerank, as text-embeddings-inference serves a cross-encoder."""
    folder, model = cross_encoder
    export_artifact(folder, tmp_path / "art", parity_shapes=SHAPES)
    logits = logits_of(model, tiny_tokenizer_dir, [(QUERY, t) for t in TEXTS])[:, 0]
    body = {"query": QUERY, "texts": TEXTS, "raw_scores": True}
    with running_server(tmp_path / "art", workers=2) as base:
        answers = [httpx.post(f"{base}{path}", json=body, timeout=30).json()
                   for path in ("/rerank", "/rerank", "/", "/invocations")]
        embed_body = httpx.post(f"{base}/", json={"inputs": "a text"}, timeout=30)
    for ranks in answers:
        np.testing.assert_allclose([r["score"] for r in sorted(ranks, key=lambda r: r["index"])], logits, atol=1e-4)
    assert_error(embed_body, 422, "invalid_request", "query")  # the root is /rerank's here, as in TEI


def test_cohere_and_jina_style_rerank_as_their_clients_call_it(cross_encoder, tiny_tokenizer_dir, tmp_path):
    """The cohere client (v2 and v1 APIs) and a Jina-style body at /rerank, as infinity and vLLM serve it:
    the documents most relevant first, at most top_n, scored as CrossEncoder.predict scores them."""
    import cohere  # a dev dependency: the real client against the real server

    folder, model = cross_encoder
    export_artifact(folder, tmp_path / "art", parity_shapes=SHAPES)
    want = 1 / (1 + np.exp(-logits_of(model, tiny_tokenizer_dir, [(QUERY, t) for t in TEXTS])[:, 0]))
    order = np.argsort(-want, kind="stable")
    with running_server(tmp_path / "art", workers=2) as base:
        v2 = cohere.ClientV2(api_key="unused", base_url=base).rerank(model="any", query=QUERY, documents=TEXTS,
                                                                     top_n=2)
        v1 = cohere.Client(api_key="unused", base_url=base).rerank(
            model="any", query=QUERY, documents=[{"text": t} for t in TEXTS], return_documents=True)
        jina = httpx.post(f"{base}/rerank", json={"model": "m", "query": QUERY, "documents": TEXTS, "top_n": 3,
                                                  "return_documents": True}, timeout=30)
        infinity = httpx.post(f"{base}/rerank", json={"query": QUERY, "documents": TEXTS, "raw_scores": True},
                              timeout=30).json()
        errors = [httpx.post(f"{base}/v1/rerank", json=body, timeout=30) for body in (
            {"query": QUERY, "documents": []}, {"query": QUERY, "documents": TEXTS, "top_n": 0},
            {"query": QUERY, "documents": [{"title": "no text"}]})]
    assert [r.index for r in v2.results] == order[:2].tolist()
    np.testing.assert_allclose([r.relevance_score for r in v2.results], want[order[:2]], atol=1e-5)
    assert [r.index for r in v1.results] == order.tolist()
    assert [r.document.text for r in v1.results] == [TEXTS[i] for i in order]
    answer = jina.json()
    assert [r["index"] for r in answer["results"]] == order[:3].tolist()
    assert [r["document"]["text"] for r in answer["results"]] == [TEXTS[i] for i in order[:3]]
    assert answer["usage"]["total_tokens"] > 0
    logits = np.log(want / (1 - want))
    np.testing.assert_allclose([r["relevance_score"] for r in infinity["results"]], logits[order], atol=1e-4)
    assert_error(errors[0], 422, "invalid_request", "empty")
    assert_error(errors[1], 422, "invalid_request", "top_n")
    assert_error(errors[2], 422, "invalid_request", "documents")


def test_huggingface_inference_client_classifies_at_the_root(tiny_tokenizer_dir, tmp_path):
    """huggingface_hub's InferenceClient.text_classification pointed at the server's URL, as at a
    text-embeddings-inference server of a classifier: POST / answers as /predict."""
    from huggingface_hub import InferenceClient

    folder, model = classifier_folder(tmp_path / "hf", tiny_tokenizer_dir, 3, seed=5)
    export_artifact(folder, tmp_path / "art", parity_shapes=SHAPES)
    logits = logits_of(model, tiny_tokenizer_dir, [TEXTS[0]])[0]
    want = np.exp(logits) / np.exp(logits).sum()
    with running_server(tmp_path / "art", workers=2) as base:
        answer = InferenceClient(base).text_classification(TEXTS[0])
        predicted = httpx.post(f"{base}/predict", json={"inputs": TEXTS[0]}, timeout=30).json()
        at_root = httpx.post(f"{base}/", json={"inputs": TEXTS[0]}, timeout=30).json()
    assert at_root == predicted
    # TEI answers one text with a flat list, highest first, of which this client keeps the first
    assert answer.label == list(LABELS.values())[int(np.argmax(want))]
    assert answer.score == pytest.approx(float(want.max()), abs=1e-5)


@pytest.mark.parametrize("id2label", [{0: "a", 1: "b", 3: "d"}, {0: "a", 1: "b", 2: "c", 3: "d"}])
def test_an_id2label_that_is_not_the_heads_outputs_is_one_line(id2label, tiny_tokenizer_dir, tmp_path):
    """Ids 0, 1, 3 on three outputs (transformers' pipeline fails on id 2), or four labels on three outputs
    (transformers refuses to load it): once served as 'LABEL_2', or with a label dropped."""
    folder, _ = classifier_folder(tmp_path / "hf", tiny_tokenizer_dir, 3, seed=5)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "id2label": id2label}))
    ids = ", ".join(map(str, id2label))
    with pytest.raises(ModelFolderError, match=f"id2label names ids {ids} but the classifier has 3 outputs"):
        export_artifact(folder, tmp_path / "art", parity_shapes=SHAPES)
    assert not (tmp_path / "art").exists()


@pytest.mark.parametrize("problem_type,scoring", [("multi_label_classification", "sigmoid"),
                                                  ("regression", "logits"), ("single_label_classification", "auto")])
def test_a_classifier_predicts_as_transformers_pipeline_scores_its_problem_type(problem_type, scoring,
                                                                                tiny_tokenizer_dir, tmp_path):
    """Several labels scored as transformers' text-classification pipeline scores config.json's problem_type:
    a multi-label classifier's (a toxicity classifier's) a sigmoid each, never a softmax that makes them
    compete (which /predict once answered); a regression's the logits themselves; a single-label one's a
    softmax. /info says which; raw_scores are the logits for all."""
    import transformers

    folder, model = classifier_folder(tmp_path / "hf", tiny_tokenizer_dir, 3, seed=5)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "problem_type": problem_type}))
    m = export_artifact(folder, tmp_path / "art", parity_shapes=SHAPES)
    written = json.loads((tmp_path / "art" / "manifest.json").read_text())
    assert m.classifier_scoring == scoring and written.get("classifier_scoring", "auto") == scoring
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(folder)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tiny_tokenizer_dir / "tokenizer.json"))
    pipeline = transformers.TextClassificationPipeline(model=hf, tokenizer=tokenizer, top_k=None)
    want = [{d["label"]: d["score"] for d in labelled} for labelled in pipeline(TEXTS[:2])]

    async def go():
        async with serving(tmp_path / "art") as (c, _):
            info = (await c.get("/info")).json()
            scored = (await c.post("/predict", json={"inputs": [[t] for t in TEXTS[:2]]})).json()
            raw = (await c.post("/predict", json={"inputs": TEXTS[0], "raw_scores": True})).json()
            return info, scored, raw
    info, scored, raw = run(go())
    assert info["classifier_scoring"] == scoring
    for row, expected in zip(scored, want):
        assert [d["score"] for d in row] == sorted((d["score"] for d in row), reverse=True)
        assert {d["label"]: d["score"] for d in row} == pytest.approx(expected, abs=1e-5)
    sums_to_one = sum(d["score"] for d in scored[0]) == pytest.approx(1.0, abs=1e-3)
    assert sums_to_one == (scoring == "auto")  # a softmax only for single-label classification
    logits = logits_of(model, tiny_tokenizer_dir, [TEXTS[0]])[0]
    assert {d["label"]: d["score"] for d in raw} == pytest.approx(dict(zip(LABELS.values(), logits)), abs=1e-5)


def test_continued_pretraining_refuses_a_classifier_naming_what_it_would_lose(cross_encoder):
    folder, _ = cross_encoder
    with pytest.raises(ModelFolderError, match="BertForSequenceClassification.*pretraining would drop that head"):
        load_model_folder(folder)  # as --init-from reads it
