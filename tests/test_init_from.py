"""`python -m training.pretrain --init-from DIR`: continued pretraining of folders that transformers
writes (with heads, without, sentence-transformers' layout), against transformers' own loss; the
trained-length rule of the folders it writes; and the one-line refusals."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer
from test_trainer import fails_in_one_line, read_metrics, write_corpus

from artifact.source_folder import trained_max_length
from training.checkpoint import list_checkpoints
from training.data import DataConfig, prepare_data
from training.model_folder import load_model_folder
from training.pretrain import main
from training.wordpiece import save_tokenizer, train_wordpiece

POSITIONS = 64


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("init_from")


@pytest.fixture(scope="module")
def corpus(root) -> Path:
    return write_corpus(root / "corpus.txt", n_docs=60, seed=7)


@pytest.fixture(scope="module")
def tokenizer_dir(root, corpus) -> Path:
    """A real WordPiece of the corpus, cased, whose tokenizer.json truncates and pads as some HF ones do."""
    tok = train_wordpiece(corpus.read_text().splitlines(), vocab_size=300, lowercase=False, min_frequency=1)
    tok.enable_truncation(8)
    tok.enable_padding(length=16)
    save_tokenizer(tok, root / "tokenizer")
    return root / "tokenizer"


def _hf_config(vocab_size: int) -> transformers.BertConfig:
    return transformers.BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                   intermediate_size=64, max_position_embeddings=POSITIONS)


def hf_folder(out: Path, tokenizer_dir: Path, model_class, **kwargs) -> Path:
    """A random transformers model saved by transformers, with the tokenizer beside it."""
    torch.manual_seed(1)
    vocab_size = len((tokenizer_dir / "vocab.txt").read_text().splitlines())
    model_class(_hf_config(vocab_size), **kwargs).save_pretrained(out)
    for f in tokenizer_dir.iterdir():
        shutil.copy2(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def pretraining_dir(root, tokenizer_dir) -> Path:
    return hf_folder(root / "hf_pretraining", tokenizer_dir, transformers.BertForPreTraining)


@pytest.fixture(scope="module")
def bare_dir(root, tokenizer_dir) -> Path:
    return hf_folder(root / "hf_bare", tokenizer_dir, transformers.BertModel)


@pytest.fixture(scope="module")
def sentence_transformers_dir(root, tokenizer_dir) -> Path:
    """The older sentence-transformers layout: the transformer (no pooler) in 0_Transformer/."""
    folder = root / "st"
    hf_folder(folder / "0_Transformer", tokenizer_dir, transformers.BertModel, add_pooling_layer=False)
    (folder / "0_Transformer" / "sentence_bert_config.json").write_text('{"max_seq_length": 48}')
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text('{"word_embedding_dimension": 32, "pooling_mode_mean_tokens": true}')
    (folder / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "0_Transformer", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    return folder


def init_args(corpus: Path, cache: Path, init_from: Path, out: Path, run_dir: Path, *extra: str) -> list[str]:
    return ["--init-from", str(init_from), "--corpus", str(corpus), "--cache-dir", str(cache), "--out", str(out),
            "--run-dir", str(run_dir), "--max-seq-len", "32", "--max-predictions", "5", "--batch-size", "8",
            "--heldout-fraction", "0.1", "--eval-batches", "1", "--no-progress", "--data-workers", "0", *extra]



def test_step_zero_loss_equals_transformers(root, corpus, pretraining_dir, tmp_path):
    """Heads kept: the first logged loss (dropout off, before any update) is transformers' loss on the
    same batch, which the data pipeline hands out again from the same settings."""
    cache = tmp_path / "cache"
    args = init_args(corpus, cache, pretraining_dir, tmp_path / "model", tmp_path / "run", "--max-steps", "1",
                     "--log-every", "1", "--dropout", "0")
    assert main(args) == 0
    logged = read_metrics(tmp_path / "run")[0]

    data = prepare_data(DataConfig(corpus=(str(corpus),), tokenizer_dir=str(pretraining_dir.resolve()),
                                   max_seq_len=32, max_predictions_per_seq=5, heldout_fraction=0.1,
                                   cache_dir=str(cache)), show_progress=False)
    assert not data.stats["built_now"]  # the very data the run read
    batch = next(data.train.batches(0, 8, seed=0))
    hf = transformers.BertForPreTraining.from_pretrained(pretraining_dir).eval()
    with torch.no_grad():
        out = hf(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                 attention_mask=batch["attention_mask"], labels=batch["mlm_labels"],
                 next_sentence_label=batch["nsp_labels"])
    assert abs(logged["loss"] - float(out.loss)) <= 1e-4, (logged["loss"], float(out.loss))

    summary = json.loads((tmp_path / "model" / "training_summary.json").read_text())
    assert summary["init_from"] == str(pretraining_dir.resolve()) and summary["preset"] is None
    # Its tokenizer_config says 512 (unknown), so the source counts as trained at all 64 positions.
    assert summary["max_length"] == POSITIONS == trained_max_length(tmp_path / "model")
    assert json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())["model_max_length"] == POSITIONS


def test_tokenizer_is_used_as_it_is_without_truncation_or_padding(root, corpus, pretraining_dir):
    data = prepare_data(DataConfig(corpus=(str(corpus),), tokenizer_dir=str(pretraining_dir), max_seq_len=32,
                                   heldout_fraction=0.05, cache_dir=str(root / "cache_tok")), show_progress=False)
    assert data.tokenizer.get_vocab() == transformers.BertTokenizerFast.from_pretrained(pretraining_dir).get_vocab()
    first = corpus.read_text().splitlines()[0]  # 12+ tokens, cased: the truncation at 8 would cut it
    expected = transformers.BertTokenizerFast.from_pretrained(pretraining_dir)(
        first, add_special_tokens=False, truncation=False)["input_ids"]
    assert data.train.shards.tokens(0, len(expected)).tolist() == expected and len(expected) > 8


def test_transformers_reads_the_tokenizer_written_as_the_sources(root, corpus, tokenizer_dir, tmp_path):
    """A tokenizer that lower-cases but keeps accents and does not split CJK characters (as transformers
    saves one): transformers builds its normaliser from tokenizer_config.json, so the folder written must
    say so, or transformers (and sentence-transformers) tokenise its texts unlike training and the server."""
    words = tmp_path / "words"
    words.mkdir()
    vocab = (tokenizer_dir / "vocab.txt").read_text().splitlines() + ["café", "cafe", "北京", "北", "京"]
    (words / "vocab.txt").write_text("\n".join(vocab) + "\n")
    (words / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "BertTokenizer", "do_lower_case": True, "strip_accents": False,
         "tokenize_chinese_chars": False}))
    saved = tmp_path / "tokenizer"
    transformers.AutoTokenizer.from_pretrained(words).save_pretrained(saved)
    shutil.copy2(words / "vocab.txt", saved)  # as transformers < 5 saves it too
    source = hf_folder(tmp_path / "source", saved, transformers.BertForPreTraining)
    out = tmp_path / "model"
    assert main(init_args(corpus, root / "cache", source, out, tmp_path / "run", "--max-steps", "1")) == 0

    text = "Café near 北京"
    expected = transformers.AutoTokenizer.from_pretrained(source)(text)["input_ids"]
    assert [vocab[i] for i in expected[1:-1]] == ["café", "near", "北京"]
    assert transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"] == expected


def test_an_untied_mlm_decoder_is_said_before_training_ties_it(root, corpus, tokenizer_dir, tmp_path, capsys):
    """tie_word_embeddings false: our BERT ties the decoder to the word embeddings, so the checkpoint's own
    decoder is not where masked-LM training starts; one notice says so, and the model written is tied."""
    source = tmp_path / "untied"
    torch.manual_seed(1)
    config = _hf_config(len((tokenizer_dir / "vocab.txt").read_text().splitlines()))
    config.tie_word_embeddings = False
    transformers.BertForPreTraining(config).save_pretrained(source)
    for f in tokenizer_dir.iterdir():
        shutil.copy2(f, source / f.name)
    capsys.readouterr()
    out = tmp_path / "model"
    assert main(init_args(corpus, root / "cache", source, out, tmp_path / "run", "--max-steps", "1")) == 0
    printed = capsys.readouterr().out
    assert f"notice: --init-from {source} has an MLM decoder of its own (tie_word_embeddings false)" in printed
    assert not load_model_folder(out).untied_mlm_decoder


@pytest.mark.parametrize("layout", ["bare", "sentence_transformers"])
def test_folder_without_heads_trains_and_writes_a_transformers_folder(layout, root, corpus, request, tmp_path):
    source = request.getfixturevalue({"bare": "bare_dir", "sentence_transformers": "sentence_transformers_dir"}[layout])
    before = load_model_folder(source)
    assert not before.has_mlm_head and not before.has_nsp_head
    assert before.has_pooler == (layout == "bare")
    out = tmp_path / "model"
    assert main(init_args(corpus, root / "cache", source, out, tmp_path / "run", "--max-steps", "3")) == 0

    hf = transformers.BertForPreTraining.from_pretrained(out, output_loading_info=True)
    model, info = hf
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    loaded = load_model_folder(out)
    assert loaded.has_mlm_head and loaded.has_nsp_head and loaded.config.hidden_size == 32
    assert loaded.model.cls.predictions.decoder.weight is loaded.model.bert.embeddings.word_embeddings.weight
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["steps"] == 3
    assert summary["max_length"] == (48 if layout == "sentence_transformers" else POSITIONS)
    # A sentence-transformers source stays one: its pooling goes with the trained weights, now at the root.
    from export.checkpoint_layout import read_layout

    layout_out = read_layout(out)
    assert layout_out.encoder_dir == out
    assert layout_out.pooling == ("mean" if layout == "sentence_transformers" else "cls")
    assert (out / "modules.json").is_file() == (layout == "sentence_transformers")


def test_a_sentence_transformers_folder_trained_longer_cuts_texts_where_the_server_does(
        root, corpus, sentence_transformers_dir, tmp_path):
    """Trained at 64 tokens, past the source's max_seq_length of 48: sentence-transformers reads the folder
    written with the length the server takes (trained_max_length), not the source's shorter one."""
    st = pytest.importorskip("sentence_transformers")
    out = tmp_path / "model"
    assert main(init_args(corpus, root / "cache", sentence_transformers_dir, out, tmp_path / "run", "--max-steps", "1",
                          "--max-seq-len", str(POSITIONS), "--max-predictions", "10", "--batch-size", "4")) == 0
    assert trained_max_length(out) == POSITIONS
    assert st.SentenceTransformer(str(out), device="cpu").max_seq_length == POSITIONS


def test_a_distilbert_masked_lm_trains_and_writes_a_bert_folder(root, corpus, tokenizer_dir, tmp_path):
    """A DistilBertForMaskedLM (read as BERT, training/distilbert.py) keeps its MLM head; the NSP head and
    the segment embeddings start fresh, and the folder written is a BERT that transformers loads whole."""
    torch.manual_seed(1)
    vocab_size = len((tokenizer_dir / "vocab.txt").read_text().splitlines())
    source = tmp_path / "distilbert"
    transformers.DistilBertForMaskedLM(transformers.DistilBertConfig(
        vocab_size=vocab_size, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
        max_position_embeddings=POSITIONS)).save_pretrained(source)
    for f in tokenizer_dir.iterdir():
        shutil.copy2(f, source / f.name)
    before = load_model_folder(source)
    assert before.has_mlm_head and not before.has_nsp_head and not before.has_pooler
    out = tmp_path / "model"
    assert main(init_args(corpus, root / "cache", source, out, tmp_path / "run", "--max-steps", "2")) == 0
    _, info = transformers.BertForPreTraining.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert load_model_folder(out).has_nsp_head


def test_resume_of_an_init_from_run_and_a_different_source_is_refused(root, corpus, pretraining_dir, bare_dir,
                                                                      tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = init_args(corpus, root / "cache", pretraining_dir, tmp_path / "model", run_dir, "--checkpoint-every", "2")
    assert main([*args, "--max-steps", "2"]) == 0
    assert [p.name for p in list_checkpoints(run_dir)] == ["ckpt-00000002.pt"]
    assert main([*args, "--max-steps", "4", "--resume"]) == 0
    assert json.loads((tmp_path / "model" / "training_summary.json").read_text())["steps"] == 4
    capsys.readouterr()

    other = init_args(corpus, root / "cache", bare_dir, tmp_path / "model", run_dir, "--checkpoint-every", "2")
    fails_in_one_line(capsys, [*other, "--max-steps", "6", "--resume"], "another configuration",
                      f"--init-from {pretraining_dir.resolve()} (now {bare_dir.resolve()})")
    fresh = [a for a in args if a not in ("--init-from", str(pretraining_dir))]
    fails_in_one_line(capsys, [*fresh, "--max-steps", "6", "--resume"], "another configuration",
                      f"--init-from {pretraining_dir.resolve()} (now not given)")


def test_a_sentence_transformers_source_is_recorded_as_given_and_its_transformer_alone_is_another(
        root, corpus, sentence_transformers_dir, tmp_path, capsys):
    """The run records the folder given, not the 0_Transformer/ its weights are in: resuming from that
    subfolder alone (no Pooling: another model) is refused, and the refusal names the folder given."""
    run_dir = tmp_path / "run"
    args = init_args(corpus, root / "cache", sentence_transformers_dir, tmp_path / "model", run_dir,
                     "--checkpoint-every", "2", "--max-steps", "2")
    assert main(args) == 0
    given = str(sentence_transformers_dir.resolve())
    assert json.loads((tmp_path / "model" / "training_summary.json").read_text())["init_from"] == given
    capsys.readouterr()
    transformer = sentence_transformers_dir / "0_Transformer"
    alone = init_args(corpus, root / "cache", transformer, tmp_path / "model", run_dir, "--max-steps", "4", "--resume")
    fails_in_one_line(capsys, alone, "another configuration", f"--init-from {given} (now {transformer.resolve()})")


@pytest.mark.parametrize("flags, expected", [
    (["--preset", "mini"], "--preset mini (4 layers, hidden 256, 4 heads) is not the shape"),
    (["--vocab-size", "400"], "--vocab-size does not go with --init-from"),
    (["--vocab-file", "vocab.txt"], "--vocab-file does not go with --init-from"),
    (["--no-lowercase"], "--no-lowercase does not go with --init-from"),
    (["--max-seq-len", "128"], f"--max-seq-len 128 is longer than the {POSITIONS} positions"),
])
def test_flags_that_contradict_the_folder_are_one_line(flags, expected, root, corpus, pretraining_dir, tmp_path,
                                                         capsys):
    out = tmp_path / "model"
    fails_in_one_line(capsys, init_args(corpus, root / "cache", pretraining_dir, out, tmp_path / "run", *flags), expected)
    assert not out.exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("case", ["gpt2", "no_config", "missing_encoder"])
def test_a_folder_that_is_not_bert_is_one_line(case, root, corpus, pretraining_dir, tmp_path, capsys):
    folder = tmp_path / "source"
    shutil.copytree(pretraining_dir, folder)
    if case == "gpt2":
        (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_layer": 2}))
    elif case == "no_config":
        (folder / "config.json").unlink()
    else:
        from safetensors.torch import load_file, save_file
        weights = load_file(str(folder / "model.safetensors"))
        save_file({k: v for k, v in weights.items() if ".layer.1." not in k}, str(folder / "model.safetensors"))
    expected = {"gpt2": "not a BERT config", "no_config": "no config.json",
                "missing_encoder": "lack"}[case]
    out = tmp_path / "model"
    fails_in_one_line(capsys, init_args(corpus, tmp_path / "cache", folder, out, tmp_path / "run"), str(folder), expected)
    assert not out.exists() and not (tmp_path / "run").exists() and not (tmp_path / "cache").exists()


def test_trained_max_length_rule(tmp_path):
    """training_summary.json, then sentence_bert_config.json, then a sane model_max_length, then the
    positions; never beyond the positions."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "max_position_embeddings": 256}))
    assert trained_max_length(folder) == 256
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": int(1e30)}))
    assert trained_max_length(folder) == 256
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    assert trained_max_length(folder) == 128
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 200}))
    assert trained_max_length(folder) == 200
    (folder / "training_summary.json").write_text(json.dumps({"phases": [{"max_seq_len": 64}, {"max_seq_len": 96}]}))
    assert trained_max_length(folder) == 96
    (folder / "training_summary.json").write_text(json.dumps({"max_length": 1000}))
    assert trained_max_length(folder) == 256


def test_legacy_checkpoint_names_load_as_transformers_loads_them(pretraining_dir, tmp_path):
    """Google's TF-converted checkpoints: LayerNorm.gamma / .beta, stored position_ids and token_type_ids
    buffers, the decoder's bias, a PyTorch .bin."""
    from safetensors.torch import load_file
    folder = tmp_path / "legacy"
    shutil.copytree(pretraining_dir, folder)
    weights = load_file(str(folder / "model.safetensors"))
    legacy = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
              for k, v in weights.items()}
    assert any(k.endswith("LayerNorm.gamma") for k in legacy)
    legacy["bert.embeddings.position_ids"] = torch.arange(POSITIONS)[None]
    legacy["bert.embeddings.token_type_ids"] = torch.zeros(1, POSITIONS, dtype=torch.int64)
    legacy["cls.predictions.decoder.bias"] = legacy.pop("cls.predictions.bias")
    (folder / "model.safetensors").unlink()
    torch.save(legacy, folder / "pytorch_model.bin")
    loaded, reference = load_model_folder(folder), load_model_folder(pretraining_dir)
    assert loaded.has_mlm_head and loaded.has_nsp_head
    ours, theirs = loaded.model.state_dict(), reference.model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_a_tokenizer_without_a_normalizer_trains_and_is_read_as_it_is(root, corpus, pretraining_dir, tmp_path):
    """tokenizer.json's `"normalizer": null` (no lower-casing, accents kept, CJK unsplit) used to stop the
    run with a traceback; transformers must then read the folder written without any of the three."""
    source = tmp_path / "source"
    shutil.copytree(pretraining_dir, source)
    spec = json.loads((source / "tokenizer.json").read_text())
    spec["normalizer"] = None
    (source / "tokenizer.json").write_text(json.dumps(spec))
    out = tmp_path / "model"
    assert main(init_args(corpus, root / "cache_null", source, out, tmp_path / "run", "--max-steps", "1")) == 0
    text = "Café near 北京, THE cat"
    ours = Tokenizer.from_file(str(source / "tokenizer.json"))
    ours.no_truncation()  # the source's tokenizer.json cuts at 8, as transformers saved it
    ours.no_padding()
    ours = ours.encode(text).ids
    assert transformers.AutoTokenizer.from_pretrained(out)(text)["input_ids"] == ours
