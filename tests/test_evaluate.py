"""`python -m training.evaluate`: our folder and a transformers BertForPreTraining folder through the
command line, the same figures on every run, agreement with transformers, and the one-line refusal of
a folder without heads."""
from __future__ import annotations

import json
import math
import sys

import pytest
import torch
import transformers
from test_init_from import hf_folder
from test_trainer import small_args, write_corpus

from training.data import DataConfig, prepare_data
from training.evaluate import main
from training.pretrain import main as pretrain
from training.wordpiece import save_tokenizer, train_wordpiece


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("evaluate")


@pytest.fixture(scope="module")
def corpus(root):
    return write_corpus(root / "corpus.txt", n_docs=40, seed=11)


@pytest.fixture(scope="module")
def our_folder(root, corpus):
    out = root / "ours"
    assert pretrain(small_args(corpus, root / "cache", out, root / "run", "--max-steps", "3",
                               "--heldout-fraction", "0.1", "--data-workers", "0")) == 0
    return out


@pytest.fixture(scope="module")
def tokenizer_dir(root, corpus):
    save_tokenizer(train_wordpiece(corpus.read_text().splitlines(), vocab_size=300, min_frequency=1), root / "tok")
    return root / "tok"


def _evaluate(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([*argv, "--no-progress"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_our_folder_gives_the_same_figures_every_run(root, corpus, our_folder, capsys):
    argv = ("--model", str(our_folder), "--corpus", str(corpus), "--cache-dir", str(root / "cache"), "--json")
    code, out, err = _evaluate(capsys, *argv)
    assert code == 0, err
    first = json.loads(out)
    assert first["max_seq_len"] == 32  # the length it was trained at
    assert first["documents"] == 40 and first["sequences"] > 0 and first["masked_tokens"] > first["sequences"]
    for key in ("mlm_accuracy", "mlm_loss", "mlm_baseline_accuracy", "nsp_accuracy", "nsp_loss",
                "nsp_baseline_accuracy"):
        assert math.isfinite(first[key]), key
    assert first["nsp_baseline_accuracy"] == 0.5  # balanced pairs, as in training
    code, out, _ = _evaluate(capsys, *argv)
    assert code == 0 and json.loads(out) == first
    code, out, _ = _evaluate(capsys, *argv, "--batch-size", "7")  # other batches, the same pairs and masks
    rebatched = json.loads(out)
    exact = [k for k in first if "loss" not in k]
    assert [rebatched[k] for k in exact] == [first[k] for k in exact]
    assert rebatched["mlm_loss"] == pytest.approx(first["mlm_loss"], abs=1e-5)

    code, out, _ = _evaluate(capsys, *argv[:-1])
    assert code == 0
    lines = out.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["model", "corpus", "MLM", "NSP"]
    assert f"accuracy {first['mlm_accuracy']:.4f}" in lines[2] and "most frequent token" in lines[2]


def test_transformers_folder_agrees_with_transformers(root, corpus, tokenizer_dir, capsys):
    folder = hf_folder(root / "hf", tokenizer_dir, transformers.BertForPreTraining)
    code, out, err = _evaluate(capsys, "--model", str(folder), "--corpus", str(corpus), "--cache-dir",
                               str(root / "cache"), "--json", "--max-sequences", "16", "--batch-size", "16")
    assert code == 0, err
    ours = json.loads(out)
    assert ours["max_seq_len"] == 64 and ours["sequences"] == 16  # its 64 positions; its tokenizer says 512

    data = prepare_data(DataConfig(corpus=(str(corpus),), tokenizer_dir=str(folder.resolve()), max_seq_len=64,
                                   max_predictions_per_seq=10, heldout_fraction=0.0, cache_dir=str(root / "cache")),
                        show_progress=False)
    batch = next(data.train.every_batch(0, 16, seed=0, max_examples=16))
    hf = transformers.BertForPreTraining.from_pretrained(folder).eval()
    with torch.no_grad():
        out = hf(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                 attention_mask=batch["attention_mask"])
    masked = batch["mlm_labels"] != -100
    logits, labels = out.prediction_logits[masked], batch["mlm_labels"][masked]
    assert ours["masked_tokens"] == int(masked.sum())
    assert round(ours["mlm_accuracy"] * len(labels)) == int((logits.argmax(-1) == labels).sum())
    assert ours["mlm_loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(logits, labels)), abs=1e-4)
    nsp = out.seq_relationship_logits
    assert round(ours["nsp_accuracy"] * 16) == int((nsp.argmax(-1) == batch["nsp_labels"]).sum())
    assert ours["nsp_loss"] == pytest.approx(float(torch.nn.functional.cross_entropy(nsp, batch["nsp_labels"])),
                                             abs=1e-4)


def test_folder_without_heads_is_one_line(root, corpus, tokenizer_dir, capsys):
    folder = hf_folder(root / "bare", tokenizer_dir, transformers.BertModel)
    capsys.readouterr()  # transformers' own progress output while saving
    code, out, err = _evaluate(capsys, "--model", str(folder), "--corpus", str(corpus), "--cache-dir",
                               str(root / "cache"))
    assert code == 2 and not out
    assert err.strip() == (f"error: {folder} has no MLM head (cls.predictions.*) and no NSP head "
                           f"(cls.seq_relationship.*): evaluation needs a BertForPreTraining checkpoint")


def test_a_folder_whose_mlm_decoder_is_untied_is_one_line(root, corpus, tokenizer_dir, capsys):
    """tie_word_embeddings false: the checkpoint's decoder is its own weight, which our BERT cannot hold (it
    ties it to the word embeddings), so its MLM figures would be another model's; a tied one loads as tied."""
    from training.model_folder import load_model_folder

    folder = root / "untied"
    torch.manual_seed(1)
    vocab = len((tokenizer_dir / "vocab.txt").read_text().splitlines())
    config = transformers.BertConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64, tie_word_embeddings=False)
    transformers.BertForPreTraining(config).save_pretrained(folder)
    for f in tokenizer_dir.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    tied = hf_folder(root / "tied", tokenizer_dir, transformers.BertForPreTraining)
    capsys.readouterr()  # transformers' own progress output while saving
    assert load_model_folder(folder).untied_mlm_decoder and not load_model_folder(tied).untied_mlm_decoder
    code, out, err = _evaluate(capsys, "--model", str(folder), "--corpus", str(corpus), "--cache-dir",
                               str(root / "cache"))
    assert code == 2 and not out
    assert err.strip() == (f"error: {folder}'s MLM decoder is a weight of its own (tie_word_embeddings false), which "
                           f"this project's BERT ties to the word embeddings: its masked-LM figures would not be the "
                           f"checkpoint's")


def test_json_on_stdout_is_the_figures_alone_while_preparation_shows_its_progress(root, corpus, our_folder, capsys,
                                                                                   monkeypatch):
    """`--json | jq` from a terminal: stderr a terminal, so preparation shows its progress, never on stdout."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code = main(["--model", str(our_folder), "--corpus", str(corpus), "--cache-dir", str(root / "cache-json"),
                 "--json"])
    captured = capsys.readouterr()
    assert code == 0 and "preparing data in" in captured.err, captured.err
    assert json.loads(captured.out)["documents"] == 40
