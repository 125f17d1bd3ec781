"""`python -m training.pretrain` end to end on small corpora: what it writes, and the one-line errors
(exit 2, no traceback, no model folder) for inputs it cannot use."""
from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_trainer import REPO, fails_in_one_line, read_metrics, small_args, write_corpus

import training.data
from training.checkpoint import list_checkpoints, load_checkpoint
from training.model_folder import load_model_folder
from training.pretrain import main
from training.wordpiece import tokenizer_from_vocab


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """One short run whose outputs several tests read (and must not change)."""
    root = tmp_path_factory.mktemp("cli")
    corpus = write_corpus(root / "corpus.txt", n_docs=80, seed=3)
    cache = root / "cache"
    args = small_args(corpus, cache, root / "model", root / "run", "--max-steps", "12", "--eval-every", "6",
                      "--checkpoint-every", "6", "--log-every", "3")
    return root, corpus, cache, args


def test_end_to_end_writes_a_loadable_folder_metrics_and_summary(finished_run, capsys):
    root, *_, args = finished_run
    assert main(args) == 0
    out = capsys.readouterr().out
    assert out.strip().splitlines()[-1].startswith("done: 12 steps")
    assert " x1: 12 steps of 8 sequences of 32 tokens; checkpoints in " in out  # the line at the start
    assert "held-out MLM accuracy" in out and "NSP accuracy" in out

    folder = root / "model"
    assert {"config.json", "model.safetensors", "tokenizer.json", "vocab.txt", "training_summary.json"} <= \
        {p.name for p in folder.iterdir()}
    # readable by others (a server user, a teammate), as export leaves its artifact
    assert folder.stat().st_mode & 0o777 == 0o755 and (folder / "model.safetensors").stat().st_mode & 0o777 == 0o644
    loaded = load_model_folder(folder)
    assert loaded.has_mlm_head and loaded.has_nsp_head and loaded.config.num_hidden_layers == 2

    import transformers
    hf = transformers.BertForPreTraining.from_pretrained(folder).eval()
    ids = torch.tensor([[2, 10, 11, 3, 12, 3]])
    with torch.no_grad():
        ours = loaded.model(ids, torch.tensor([[0, 0, 0, 0, 1, 1]]), torch.ones_like(ids))
        theirs = hf(input_ids=ids, token_type_ids=torch.tensor([[0, 0, 0, 0, 1, 1]]),
                    attention_mask=torch.ones_like(ids))
    assert torch.allclose(ours.nsp_logits, theirs.seq_relationship_logits, atol=1e-4)

    summary = json.loads((folder / "training_summary.json").read_text())
    assert summary["steps"] == 12 and summary["tokens_seen"] > 0 and summary["wall_time_s"] > 0
    for key in ("mlm_accuracy", "mlm_baseline_accuracy", "nsp_accuracy", "nsp_baseline_accuracy", "mlm_loss"):
        assert key in summary["heldout"]
    assert summary["versions"]["torch"] == torch.__version__
    assert summary["data_stats"][0]["documents"] == 80
    heldout = summary["data_stats"][0]["heldout"]  # what the held-out figures were scored on, said at the start
    assert heldout.startswith("held out 8 documents, ") and heldout in out.splitlines()
    # The longest sequence trained at, where export and transformers' tokenizer look for it.
    assert summary["max_length"] == 32
    assert json.loads((folder / "tokenizer_config.json").read_text())["model_max_length"] == 32

    train_events = read_metrics(root / "run")
    assert [r["step"] for r in train_events] == [3, 6, 9, 12]
    assert {"loss", "mlm_loss", "nsp_loss", "lr", "tokens_per_s", "tokens_seen", "grad_norm"} <= train_events[0].keys()
    assert [r["step"] for r in read_metrics(root / "run", "eval")] == [6, 12]
    assert [p.name for p in list_checkpoints(root / "run")] == ["ckpt-00000006.pt", "ckpt-00000012.pt"]



def test_rerun_without_resume_is_refused_and_other_configurations_too(finished_run, capsys):
    root, corpus, cache, args = finished_run
    if not list_checkpoints(root / "run"):
        assert main(args) == 0
    before = (root / "model" / "model.safetensors").read_bytes()
    fails_in_one_line(capsys, args, "holds checkpoints of an earlier run", "--resume")
    fails_in_one_line(capsys, [*args, "--resume", "--preset", "mini"], "another configuration",
                      "--preset tiny (now mini)")
    fails_in_one_line(capsys, [*args, "--resume", "--vocab-size", "400"], "another configuration",
                      "--vocab-size 300 (now 400)")
    assert (root / "model" / "model.safetensors").read_bytes() == before  # the folder was left alone


@pytest.mark.parametrize("flags, expected", [
    (["--batch-size", "4"], "--batch-size 8 (now 4)"), (["--seed", "1"], "--seed 0 (now 1)"),
    (["--max-seq-len", "48"], "--max-seq-len 32 (now 48)"),
    (["--whole-word-masking"], "--whole-word-masking off (now on)"),
    (["--text-field", "body"], "--text-field text (now body)"),
    (["--max-steps", "10"], "is at step 12, past --max-steps 10; pass --max-steps 12 or more"),
])
def test_resume_refuses_a_flag_the_checkpoint_was_made_under_and_writes_nothing(flags, expected, finished_run,
                                                                               capsys):
    root, _, _, args = finished_run
    if not list_checkpoints(root / "run"):
        assert main(args) == 0
    before = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
    fails_in_one_line(capsys, [*args, "--resume", *flags], "checkpoint", expected)
    assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == before


def test_the_start_line_gives_each_phase_and_a_line_marks_where_phase_2_begins(tmp_path, capsys):
    corpus = write_corpus(tmp_path / "corpus.txt", n_docs=80, seed=3)
    args = small_args(corpus, tmp_path / "cache", tmp_path / "model", tmp_path / "run", "--max-steps", "2",
                      "--phase2-steps", "3", "--phase2-seq-len", "48", "--phase2-batch-size", "4", "--grad-accum", "2",
                      "--eval-every", "0")
    assert main(args) == 0
    out = capsys.readouterr().out.splitlines()
    start = next(line for line in out if line.startswith("training "))
    assert (" x1: phase 1: 2 steps of 16 sequences of 32 tokens, phase 2: 3 steps of 8 sequences of 48 tokens; "
            "checkpoints in ") in start, start
    assert "step 2: phase 2 begins, 3 steps of 8 sequences of 48 tokens" in out, out


def test_resume_takes_more_steps_and_new_optimiser_settings_and_says_so(tmp_path, capsys):
    """Phase 2's flags and where it starts (--max-steps) are the checkpoint's once phase 2 has begun; before,
    they are taken as the run's length and the optimiser's settings are, each said in the line at the start."""
    corpus = write_corpus(tmp_path / "corpus.txt", n_docs=80, seed=3)
    args = small_args(corpus, tmp_path / "cache", tmp_path / "model", tmp_path / "run", "--phase2-seq-len", "48",
                      "--checkpoint-every", "2", "--keep-checkpoints", "5", "--eval-every", "0", "--log-every", "1")
    assert main([*args, "--max-steps", "2", "--phase2-steps", "2"]) == 0
    in_phase2 = list_checkpoints(tmp_path / "run")[-1]
    assert in_phase2.name == "ckpt-00000004.pt"
    for flags, expected in ((["--max-steps", "3", "--phase2-steps", "2"], "--max-steps 2 (now 3)"),
                            (["--max-steps", "2", "--phase2-steps", "2", "--phase2-batch-size", "4"],
                             "--phase2-batch-size 8 (now 4)"),
                            (["--max-steps", "2", "--phase2-steps", "1"],
                             "past --max-steps 2 + --phase2-steps 1; pass --phase2-steps 2 or more")):
        fails_in_one_line(capsys, [*args, *flags, "--resume"], expected)

    in_phase2.unlink()  # from step 2, the end of phase 1: phase 2 has not begun
    assert main([*args, "--max-steps", "3", "--phase2-steps", "2", "--phase2-batch-size", "4", "--weight-decay", "0.5",
                 "--resume"]) == 0
    assert ("resuming at step 2 with --max-steps 3 (was 2), --phase2-batch-size 4 (was 8), --weight-decay 0.5 "
            "(was 0.01)") in capsys.readouterr().out.splitlines()
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3, 4, 5]
    state = load_checkpoint(list_checkpoints(tmp_path / "run")[-1])
    assert [g["weight_decay"] for g in state["optimizer"]["param_groups"]] == [0.5, 0.0]  # not the checkpoint's


def test_resume_into_another_out_of_the_same_name_is_refused_from_the_default_run_folder(tmp_path, capsys,
                                                                                        monkeypatch):
    """The default --run-dir is runs/<--out's folder name>: a new --out elsewhere with that name must not
    continue the other model's run (`make` always passes --resume), nor delete it with --fresh; with its
    own --run-dir it may train."""
    monkeypatch.chdir(tmp_path)  # runs/ is made in the working folder
    corpus = write_corpus(tmp_path / "corpus.txt", n_docs=80, seed=3)

    def args(out: Path, *extra: str) -> list[str]:
        flags = small_args(corpus, tmp_path / "cache", out, tmp_path / "unused", "--max-steps", "2",
                           "--checkpoint-every", "2", "--eval-every", "0", *extra)
        at = flags.index("--run-dir")
        return flags[:at] + flags[at + 2:]  # the default run folder

    assert main(args(tmp_path / "a" / "model")) == 0
    assert list_checkpoints(tmp_path / "runs" / "model")
    for flags in (["--resume"], ["--fresh"], []):  # --fresh would delete the other model's run
        fails_in_one_line(capsys, args(tmp_path / "b" / "model", *flags),
                          f"is of the run that writes {tmp_path / 'a' / 'model'}, not --out {tmp_path / 'b' / 'model'}",
                          "pass --run-dir")
    assert not (tmp_path / "b").exists() and list_checkpoints(tmp_path / "runs" / "model")
    assert main(args(tmp_path / "a" / "model", "--max-steps", "3", "--resume")) == 0  # its own run goes on


def test_resume_takes_a_corpus_however_it_is_spelt_and_refuses_other_files(tmp_path, capsys):
    """A folder, a glob of it and its files are one corpus: a run made with one resumes with the others, a
    checkpoint that recorded the spelling (as checkpoints did before) too; other files, or the same in
    another order (another data order), are refused."""
    data = tmp_path / "data"
    data.mkdir()
    a, b = write_corpus(data / "a.txt", n_docs=40, seed=1), write_corpus(data / "b.txt", n_docs=40, seed=2)
    (data / ".a.txt.swp.txt").write_text("An editor's copy. A glob leaves it out, and so does the folder.\n")
    cache = tmp_path / "cache"
    flags = small_args(data, cache, tmp_path / "model", tmp_path / "run", "--max-steps", "2",
                       "--checkpoint-every", "2")

    def spelt(*corpus: Path | str) -> list[str]:
        at = flags.index("--corpus") + 1
        return [*flags[:at], *map(str, corpus), *flags[at + 1:]]

    assert main(spelt(data / "*.txt")) == 0
    for corpus in ([data], [f"{data}/"], [a, b], [data / "*.txt"]):
        assert main([*spelt(*corpus), "--resume"]) == 0, corpus
    assert len(list(cache.glob("data-*"))) == 1  # the same files in the same order: one prepared data set

    newest = list_checkpoints(tmp_path / "run")[-1]
    state = torch.load(newest, weights_only=True)
    torch.save({**state, "data_config": {**state["data_config"], "corpus": [str(data)]}}, newest)
    assert main([*spelt(a, b), "--resume"]) == 0

    capsys.readouterr()
    fails_in_one_line(capsys, [*spelt(a), "--resume"], "another --corpus: 1 file now against its 2 files",
                      f"not given: {b}")
    fails_in_one_line(capsys, [*spelt(b, a), "--resume"],
                      "another --corpus: the same 2 files in another order (quote a glob")


def test_resume_refuses_a_corpus_file_changed_since_and_takes_it_back_as_it_was(tmp_path, capsys):
    """The checkpoint's data position counts sentences of the corpus as it was: a file grown, or edited in
    place at the same size, is refused naming it; put back as it was, the run resumes. A checkpoint from
    before the contents were recorded resumes as before."""
    a = write_corpus(tmp_path / "a.txt", n_docs=40, seed=1)
    b = write_corpus(tmp_path / "b.txt", n_docs=40, seed=2)
    flags = small_args(a, tmp_path / "cache", tmp_path / "model", tmp_path / "run", "--max-steps", "2",
                       "--checkpoint-every", "2")
    at = flags.index("--corpus") + 1
    flags[at:at + 1] = [str(a), str(b)]
    assert main(flags) == 0
    original = b.read_bytes()
    capsys.readouterr()
    b.write_bytes(original + b"\nA document added since.\n")
    fails_in_one_line(capsys, [*flags, "--resume"], f"other contents of {b}", f"{len(original)} bytes then")
    b.write_bytes(original[:-12] + original[-12:].swapcase())
    fails_in_one_line(capsys, [*flags, "--resume"], f"other contents of {b} (the same size, other bytes)")
    b.write_bytes(original)
    assert main([*flags, "--resume", "--max-steps", "4"]) == 0

    newest = list_checkpoints(tmp_path / "run")[-1]
    state = torch.load(newest, weights_only=True)
    torch.save({k: v for k, v in state.items() if k != "corpus_contents"}, newest)
    b.write_bytes(original + b"\nNot seen by a checkpoint that recorded nothing of it.\n")
    assert main([*flags, "--resume", "--max-steps", "6"]) == 0


def _tokenizer_training_comes_out_otherwise(monkeypatch, tmp_path: Path) -> None:
    """A tokenizer trained from now on gets other ids than one trained before on the same corpus, as another
    `tokenizers` version's may: its last two tokens swap places."""
    real = training.data.train_wordpiece

    def trained_otherwise(*args, **kwargs):
        vocab = [t for t, _ in sorted(real(*args, **kwargs).get_vocab().items(), key=lambda kv: kv[1])]
        vocab[-2:] = vocab[:-3:-1]
        (tmp_path / "otherwise.txt").write_text("".join(f"{t}\n" for t in vocab), encoding="utf-8")
        return tokenizer_from_vocab(tmp_path / "otherwise.txt")

    monkeypatch.setattr(training.data, "train_wordpiece", trained_otherwise)


def test_resume_without_its_data_cache_prepares_the_data_with_the_checkpoints_tokenizer(tmp_path, monkeypatch):
    """Another machine, a deleted cache: the data is tokenised again with the vocabulary the weights were
    trained on, not with one trained anew; a checkpoint written before checkpoints kept it resumes as before."""
    corpus = write_corpus(tmp_path / "corpus.txt", n_docs=80, seed=3)
    args = small_args(corpus, tmp_path / "cache", tmp_path / "model", tmp_path / "run", "--checkpoint-every", "2")
    assert main([*args, "--max-steps", "2"]) == 0
    vocab = (tmp_path / "model" / "vocab.txt").read_text()
    shutil.rmtree(tmp_path / "cache")
    _tokenizer_training_comes_out_otherwise(monkeypatch, tmp_path)
    assert main([*args, "--max-steps", "4", "--resume"]) == 0
    assert (tmp_path / "model" / "vocab.txt").read_text() == vocab
    assert [(p / "tokenizer" / "vocab.txt").read_text() for p in (tmp_path / "cache").glob("data-*")] == [vocab]

    newest = list_checkpoints(tmp_path / "run")[-1]
    torch.save({k: v for k, v in torch.load(newest, weights_only=True).items() if k != "tokenizer"}, newest)
    shutil.rmtree(tmp_path / "cache")
    assert main([*args, "--max-steps", "6", "--resume"]) == 0


def test_resume_refuses_data_tokenised_otherwise_and_writes_nothing(tmp_path, capsys, monkeypatch):
    """A --cache-dir prepared by another run whose tokenizer came out otherwise, or a --vocab-file changed since:
    the checkpoint's ids would mean other tokens. Refused in one line before any step, the run folder left
    as it is."""
    corpus = write_corpus(tmp_path / "corpus.txt", n_docs=80, seed=3)
    args = small_args(corpus, tmp_path / "cache", tmp_path / "model", tmp_path / "run", "--max-steps", "2",
                      "--checkpoint-every", "2")
    assert main(args) == 0
    with monkeypatch.context() as m:
        _tokenizer_training_comes_out_otherwise(m, tmp_path)
        assert main(small_args(corpus, tmp_path / "other", tmp_path / "model2", tmp_path / "run2", "--max-steps",
                               "1")) == 0
    checkpoint = list_checkpoints(tmp_path / "run")[-1]
    at = args.index("--cache-dir") + 1
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")}
    fails_in_one_line(capsys, [*args[:at], str(tmp_path / "other"), *args[at + 1:], "--resume"],
                      f"checkpoint {checkpoint} was trained with another tokenizer", f"{tmp_path / 'other'}",
                      "another --cache-dir")
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")} == before

    vocab = tmp_path / "vocab.txt"
    shutil.copy(tmp_path / "model" / "vocab.txt", vocab)
    with_vocab = small_args(corpus, tmp_path / "cache", tmp_path / "model3", tmp_path / "run3", "--max-steps", "2",
                            "--checkpoint-every", "2", "--vocab-file", str(vocab))
    assert main(with_vocab) == 0
    lines = vocab.read_text().splitlines(keepends=True)
    vocab.write_text("".join(lines[:-2] + lines[:-3:-1]))
    caches = sorted((tmp_path / "cache").iterdir())
    fails_in_one_line(capsys, [*with_vocab, "--resume"], "another tokenizer", f"--vocab-file {vocab}")
    assert sorted((tmp_path / "cache").iterdir()) == caches  # refused before the corpus was tokenised again


def test_a_relative_vocab_file_resumes_from_another_working_folder(tmp_path, capsys, monkeypatch):
    """--vocab-file is recorded as the file it names (absolute), as --corpus is; a checkpoint that recorded it
    as typed (as checkpoints did before) resumes with the same file, named from the folder it was typed in."""
    corpus = write_corpus(tmp_path / "corpus.txt", n_docs=80, seed=3)
    args = small_args(corpus, tmp_path / "cache", tmp_path / "model", tmp_path / "run", "--max-steps", "2",
                      "--checkpoint-every", "2")
    assert main(args) == 0
    (tmp_path / "vocab").mkdir()
    vocab = tmp_path / "vocab" / "vocab.txt"
    shutil.copy(tmp_path / "model" / "vocab.txt", vocab)
    args = [*args[:args.index("--run-dir") + 1], str(tmp_path / "run2"), *args[args.index("--run-dir") + 2:]]

    monkeypatch.chdir(tmp_path / "vocab")
    assert main([*args, "--vocab-file", "vocab.txt"]) == 0
    monkeypatch.chdir(tmp_path)
    assert main([*args, "--vocab-file", "vocab/vocab.txt", "--resume"]) == 0
    assert load_checkpoint(list_checkpoints(tmp_path / "run2")[-1])["data_config"]["vocab_file"] == str(vocab)

    newest = list_checkpoints(tmp_path / "run2")[-1]
    state = torch.load(newest, weights_only=True)
    torch.save({**state, "data_config": {**state["data_config"], "vocab_file": "vocab.txt"},
                "flags": {**state["flags"], "--vocab-file": "vocab.txt"}}, newest)
    monkeypatch.chdir(tmp_path / "vocab")
    assert main([*args, "--vocab-file", str(vocab), "--resume"]) == 0
    shutil.copy(vocab, tmp_path / "copy.txt")
    fails_in_one_line(capsys, [*args, "--vocab-file", "../copy.txt", "--resume"], "another configuration",
                      f"--vocab-file {vocab} (now {tmp_path / 'copy.txt'})")


def test_a_checkpoint_from_before_the_heldout_split_left_out_training_text_resumes_and_says_so(finished_run, tmp_path,
                                                                                              capsys):
    """Its held-out evaluations were scored partly on sentences that training documents hold. Its training
    data and pairs are the same, so it resumes (a long run is not started over for an evaluation's sake),
    with one line saying that its held-out figures change text where it resumes; the checkpoints it writes
    record the split. Another split recorded is refused like any other changed setting."""
    root, corpus, cache, _ = finished_run
    run_dir = tmp_path / "run"
    args = small_args(corpus, cache, tmp_path / "model", run_dir, "--max-steps", "2", "--checkpoint-every", "2")
    assert main(args) == 0
    newest = list_checkpoints(run_dir)[-1]
    state = torch.load(newest, weights_only=True)
    data_config = state["data_config"]
    torch.save({**state, "data_config": {k: v for k, v in data_config.items() if k != "heldout_split"}}, newest)
    capsys.readouterr()
    assert main([*args, "--resume", "--max-steps", "4"]) == 0
    out = capsys.readouterr().out
    said = [line for line in out.splitlines() if "made before the held-out split" in line]
    assert said == [f"checkpoint {newest} was made before the held-out split left out the sentences that training "
                    f"documents also hold: its held-out figures up to step 2 were scored partly on text the model "
                    f"trained on, and from here on they are not, so expect them to drop there"], out
    resumed = torch.load(list_checkpoints(run_dir)[-1], weights_only=True)
    assert resumed["step"] == 4 and resumed["data_config"]["heldout_split"] == data_config["heldout_split"]
    torch.save({**resumed, "data_config": {**resumed["data_config"], "heldout_split": "another split"}},
               list_checkpoints(run_dir)[-1])
    fails_in_one_line(capsys, [*args, "--resume", "--max-steps", "6"], "another configuration",
                      "heldout_split 'another split'")


def test_corrupt_checkpoint_is_named(finished_run, tmp_path, capsys):
    root, corpus, cache, _ = finished_run
    run_dir = tmp_path / "run"
    args = small_args(corpus, cache, tmp_path / "model", run_dir, "--max-steps", "4", "--checkpoint-every", "2")
    assert main(args) == 0
    newest = list_checkpoints(run_dir)[-1]
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    fails_in_one_line(capsys, [*args, "--resume", "--max-steps", "6"], str(newest), "ckpt-00000002.pt")


@pytest.mark.parametrize("case", ["missing", "empty", "one_document", "unknown_preset", "bad_steps",
                                  "graphs_uncompiled", "graphs_on_cpu", "zero_lr", "nan_weight_decay",
                                  "negative_clip_norm", "zero_phase2_batch", "small_heldout_split",
                                  "small_training_split", "too_many_predictions", "no_heldout", "nan_heldout",
                                  "one_sentence_documents", "utf16", "utf16_without_bom", "gzip_named_txt",
                                  "binary"])
def test_bad_input_is_one_line_and_writes_nothing(case, tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    extra: list[str] = []
    if case == "empty":
        corpus.write_text("\n\n   \n")
    elif case == "one_document":
        corpus.write_text("Just one document.\nIt has two sentences but nothing to pair it with.\n")
    elif case == "utf16":  # as Windows' Notepad saves "Unicode"
        write_corpus(corpus, n_docs=10)
        corpus.write_bytes(corpus.read_text().encode("utf-16"))
    elif case in ("utf16_without_bom", "gzip_named_txt", "binary"):  # were trained on as text (garbage)
        import gzip
        (tmp_path / "data").mkdir()
        text = write_corpus(tmp_path / "data" / "good.txt", n_docs=20).read_text()
        corpus = tmp_path / "data" / "more.txt"
        corpus.write_bytes({"utf16_without_bom": text.encode("utf-16-le"),
                            "gzip_named_txt": gzip.compress(text.encode()),
                            "binary": Path(sys.executable).read_bytes()[:20000]}[case])
        corpus = corpus.parent  # a folder of good text and this file
    elif case == "one_sentence_documents":  # every pair NotNext: balancing keeps none
        corpus.write_text("\n\n".join(f"document {i} is one sentence of words without a full stop" for i in range(200)))
    elif case != "missing":
        write_corpus(corpus, n_docs=10)
        extra = {"unknown_preset": ["--preset", "huge"], "bad_steps": ["--max-steps", "0"],
                 "graphs_uncompiled": ["--cuda-graphs"],
                 "graphs_on_cpu": ["--cuda-graphs", "--compile", "--device", "cpu"],
                 "zero_lr": ["--lr", "0"], "nan_weight_decay": ["--weight-decay", "nan"],
                 "negative_clip_norm": ["--clip-norm", "-1"], "zero_phase2_batch": ["--phase2-batch-size", "0"],
                 "small_heldout_split": [],
                 "small_training_split": ["--heldout-fraction", "0.5", "--batch-size", "64"],
                 "too_many_predictions": ["--max-predictions", "1000"],
                 "no_heldout": ["--heldout-fraction", "0"], "nan_heldout": ["--heldout-fraction", "nan"]}[case]
    out = tmp_path / "model"
    expected = {"missing": "does not exist", "empty": "", "one_document": "document",
                "unknown_preset": "unknown preset 'huge'", "bad_steps": "--max-steps",
                "graphs_uncompiled": "--cuda-graphs needs --compile", "graphs_on_cpu": "needs a CUDA device",
                "zero_lr": "--lr must be above 0, got 0.0", "nan_weight_decay": "--weight-decay must be 0 or more",
                "negative_clip_norm": "--clip-norm must be 0 or more",
                "zero_phase2_batch": "--phase2-batch-size must be at least 1",
                # the advice that helps the split that is short
                "small_heldout_split": "held-out split has 4 sequence pairs at length 32, fewer than one batch of 8 "
                                       "x 1 processes; add text, pass --batch-size 4 or less, or raise "
                                       "--heldout-fraction to 0.4",
                "small_training_split": "training split has 10 sequence pairs at length 32, fewer than one batch "
                                        "of 64 x 1 processes; add text, pass --batch-size 10 or less, or lower "
                                        "--heldout-fraction",
                "too_many_predictions": "--max-predictions must lie in [1, 29] at --max-seq-len 32, got 1000",
                "no_heldout": "--heldout-fraction must lie in (0, 0.5]", "nan_heldout": "got nan",
                "one_sentence_documents": "few of its documents have the two sentences or more that an IsNext "
                                          "pair needs; give longer documents, or pass --no-nsp-balance",
                "utf16": "is UTF-16 text (it starts with a UTF-16 byte-order mark); convert it to UTF-8",
                "utf16_without_bom": "more.txt is not UTF-8 text: it holds NUL bytes in its first 8 KB, as a binary "
                                     "file or UTF-16/UTF-32 text without a byte-order mark does; convert it to UTF-8",
                "binary": "more.txt is not UTF-8 text: it holds NUL bytes",
                "gzip_named_txt": "more.txt is gzip-compressed; name it more.txt.gz"}[case]
    fails_in_one_line(capsys, small_args(corpus, tmp_path / "cache", out, tmp_path / "run", *extra), expected)
    assert not out.exists()
    assert not list(tmp_path.glob(".model*"))  # no temporary model folder either
    if case in ("utf16", "utf16_without_bom", "gzip_named_txt", "binary"):  # nor prepared data, whole or part
        assert not list((tmp_path / "cache").glob("*data-*"))


def test_the_figures_a_short_split_suggests_each_let_the_run_train(tmp_path, capsys):
    """Each way out that the refusal of a short held-out split names, with its figure, is enough alone."""
    corpus = write_corpus(tmp_path / "corpus.txt", n_docs=10)

    def args(name: str, *extra: str) -> list[str]:
        return small_args(corpus, tmp_path / "cache", tmp_path / name, tmp_path / f"run_{name}", "--max-steps", "1",
                          "--eval-every", "0", *extra)

    fails_in_one_line(capsys, args("refused"), "pass --batch-size 4 or less, or raise --heldout-fraction to 0.4")
    assert main(args("smaller_batch", "--batch-size", "4")) == 0
    assert main(args("larger_fraction", "--heldout-fraction", "0.4")) == 0


@pytest.mark.parametrize("case", ["a_token_twice", "not_utf8"])
def test_a_vocab_file_that_cannot_size_a_model_is_one_line_and_writes_nothing(case, tmp_path, capsys):
    """A token on two lines would leave an id unused and the embeddings one row short of the ids; a file in
    another encoding is not read as garbage tokens."""
    corpus = write_corpus(tmp_path / "corpus.txt", n_docs=80, seed=3)
    words = sorted(set(corpus.read_text().lower().replace(".", " ").split()))
    vocab = tmp_path / "vocab.txt"
    if case == "a_token_twice":
        vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words, words[3]]) + "\n")
        expected = f"line {5 + 3 + 1} ({words[3]!r}) appears again on a later line"
    else:
        vocab.write_bytes("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words, "café"]).encode("latin-1"))
        expected = f"is not UTF-8 text (line {5 + len(words) + 1})"
    args = small_args(corpus, tmp_path / "cache", tmp_path / "model", tmp_path / "run", "--max-steps", "2")
    i = args.index("--vocab-size")
    fails_in_one_line(capsys, [*args[:i], *args[i + 2:], "--vocab-file", str(vocab)], f"vocab file {vocab}", expected)
    assert not (tmp_path / "model").exists() and not (tmp_path / "run").exists()


def test_a_vocabulary_that_does_not_fit_the_corpus_is_warned_of(tmp_path, caplog):
    """A vocab.txt of another language (here: two words) reads most of the corpus as [UNK]; the run goes on,
    since the file may be what the user means, but says so before the hours of training."""
    corpus = write_corpus(tmp_path / "corpus.txt", n_docs=80, seed=3)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "in"]) + "\n")
    args = small_args(corpus, tmp_path / "cache", tmp_path / "model", tmp_path / "run", "--max-steps", "1")
    i = args.index("--vocab-size")
    with caplog.at_level("WARNING"):
        assert main([*args[:i], *args[i + 2:], "--vocab-file", str(vocab)]) == 0
    warned = [r.getMessage() for r in caplog.records if "[UNK]" in r.getMessage()]
    assert len(warned) == 1 and "its vocabulary does not fit this text" in warned[0], caplog.text
    stats = json.loads((tmp_path / "model" / "training_summary.json").read_text())["data_stats"][0]
    assert stats["unknown_token_rate"] > 0.5  # recorded with the run
    caplog.clear()  # a vocabulary trained on the corpus: no warning
    assert main(small_args(corpus, tmp_path / "cache", tmp_path / "model2", tmp_path / "run2", "--max-steps", "1")) == 0
    assert not [r for r in caplog.records if "[UNK]" in r.getMessage()]


@pytest.mark.parametrize("case", ["other_files", "a_file", "working_folder", "init_from_itself", "user_file",
                                  "exported_artifact", "run_dir_inside", "cache_dir_inside", "corpus_inside",
                                  "working_folder_inside"])
def test_an_out_that_is_not_a_model_folder_is_refused_and_left_as_it_is(case, tmp_path, capsys, monkeypatch,
                                                                      tiny_model_dir):
    """The model folder is written whole over --out: where that would destroy something else, the run is
    refused before it starts, and what was there stays."""
    import shutil

    corpus = write_corpus(tmp_path / "corpus.txt", n_docs=10)
    out = tmp_path / "out"
    run_dir, cache = tmp_path / "run", tmp_path / "cache"
    if case in ("user_file", "exported_artifact", "run_dir_inside", "cache_dir_inside", "corpus_inside",
                "working_folder_inside"):
        shutil.copytree(tiny_model_dir, out)  # an earlier model folder: retraining into it is allowed
    if case == "user_file":
        (out / "notes.md").write_text("what this model is for")
        expected = "holds what a model folder does not (notes.md)"
    elif case == "exported_artifact":
        (out / "onnx").mkdir()
        (out / "onnx" / "model.onnx").write_bytes(b"an export")
        expected = "holds what a model folder does not (onnx/)"
    elif case == "run_dir_inside":
        run_dir = out / "run"  # not there yet: the run would make it, and the model folder replace it
        expected = f"holds --run-dir {run_dir}"
    elif case == "cache_dir_inside":
        cache = out / "cache"
        expected = f"holds --cache-dir {cache}"
    elif case == "corpus_inside":
        corpus = Path(shutil.move(corpus, out / "corpus.txt"))
        expected = f"holds --corpus {corpus}"
    elif case == "working_folder_inside":
        (out / "1_Pooling").mkdir()  # a folder no modules.json names: not the model's
        monkeypatch.chdir(out / "1_Pooling")
        expected = "holds the working folder"
    elif case == "other_files":
        (out / "sub").mkdir(parents=True)
        (out / "thesis.tex").write_text("months of work")
        expected = "is not a model folder"
    elif case == "a_file":
        out.write_text("months of work")
        expected = "is not a folder"
    elif case == "working_folder":
        monkeypatch.chdir(tmp_path)
        out = Path(".")
        expected = "name the model folder"
    else:
        out = Path(shutil.copytree(tiny_model_dir, tmp_path / "mine"))
        expected = "is the --init-from folder itself"
    before = {q: q.read_bytes() for q in out.rglob("*") if q.is_file()} if out.is_dir() else out.read_bytes()
    args = small_args(corpus, cache, out, run_dir)
    if case == "init_from_itself":
        args = [a for a in args if a not in ("--vocab-size", "300")] + ["--init-from", str(out)]
    fails_in_one_line(capsys, args, expected)
    after = {q: q.read_bytes() for q in out.rglob("*") if q.is_file()} if out.is_dir() else out.read_bytes()
    assert after == before
    assert not cache.exists() or not any(cache.iterdir())  # refused before the data
    assert not run_dir.exists()


def test_retraining_into_an_earlier_model_folder_replaces_it(tmp_path, capsys, tiny_model_dir):
    """What a model folder holds (a sentence-transformers model's module folders too) is no reason to
    refuse: the new model replaces it whole, and nothing of the old one stays."""
    corpus = write_corpus(tmp_path / "corpus.txt", n_docs=80, seed=3)
    out = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    (out / "1_Pooling").mkdir()
    (out / "1_Pooling" / "config.json").write_text('{"pooling_mode": "mean"}')
    (out / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    old_weights = (out / "model.safetensors").read_bytes()
    assert main(small_args(corpus, tmp_path / "cache", out, tmp_path / "run", "--max-steps", "2")) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["config.json", "model.safetensors", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
         "training_summary.json", "vocab.txt"])
    assert (out / "model.safetensors").read_bytes() != old_weights
    load_model_folder(out)


def test_an_out_spelt_through_itself_is_replaced_not_lost(tmp_path, capsys, tiny_model_dir):
    """`--out models/m/../m` names the folder through itself: the first of the final renames (m -> .m.old)
    took that path away, and the run ended with neither model in place. Both an earlier folder and none."""
    corpus = write_corpus(tmp_path / "corpus.txt", n_docs=80, seed=3)
    earlier = Path(shutil.copytree(tiny_model_dir, tmp_path / "models" / "m"))
    old_weights = (earlier / "model.safetensors").read_bytes()
    for out, run in ((earlier / ".." / "m", "run-m"), (tmp_path / "models" / "new" / ".." / "new", "run-new")):
        assert main(small_args(corpus, tmp_path / "cache", out, tmp_path / run, "--max-steps", "2")) == 0
        load_model_folder(out)
    assert (earlier / "model.safetensors").read_bytes() != old_weights
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["m", "new"]  # no .old, lock or partial


def test_undecodable_bytes_and_a_huge_line_still_train(tmp_path):
    """Bad UTF-8 is replaced (with a warning), a 2 MB line is cut into pieces: no traceback."""
    corpus = write_corpus(tmp_path / "corpus.txt", n_docs=30, seed=5)
    with open(corpus, "ab") as f:
        f.write(b"\nA line with \xff\xfe bytes that are not UTF-8.\nAnd one more sentence.\n\n")
        f.write(b"word " * 400_000 + b"\n")
    cmd = [sys.executable, "-m", "training.pretrain",
           *small_args(corpus, tmp_path / "cache", tmp_path / "model", tmp_path / "run", "--max-steps", "2",
                      "--heldout-fraction", "0.2")]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert (tmp_path / "model" / "model.safetensors").is_file()


def test_help_lists_every_knob():
    done = subprocess.run([sys.executable, "-m", "training.pretrain", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0
    for flag in ("--corpus", "--preset", "--out", "--max-steps", "--max-seq-len", "--resume", "--batch-size",
                 "--grad-accum", "--lr", "--warmup-steps", "--weight-decay", "--clip-norm", "--seed",
                 "--eval-every", "--eval-batches", "--checkpoint-every", "--keep-checkpoints", "--vocab-size",
                 "--vocab-file", "--no-lowercase", "--whole-word-masking", "--max-predictions", "--compile",
                 "--device", "--precision", "--phase2-seq-len", "--phase2-steps", "--cache-dir", "--run-dir",
                 "--init-from", "--ddp-bf16-grads", "--ddp-bucket-mb", "--no-ddp-bucket-view", "--ddp-static-graph"):
        assert flag in done.stdout, flag


def test_flags_left_out_give_the_demonstration_only_on_the_embedded_corpus():
    from training.pretrain import SCHEDULE_DEFAULTS, build_parser, fill_defaults

    demo = fill_defaults(build_parser().parse_args([]))
    assert (demo.max_steps, demo.max_seq_len, demo.batch_size, demo.vocab_size, demo.phase2_steps,
            demo.phase2_seq_len, demo.phase2_batch_size) == (1100, 48, 192, 4096, 900, 128, 32)
    assert (demo.max_predictions, demo.phase2_max_predictions) == (8, 20)  # BERT's 20 per 128 tokens
    own = fill_defaults(build_parser().parse_args(["--corpus", "notes.txt"]))
    assert {k: getattr(own, k) for k in SCHEDULE_DEFAULTS["other"]} == SCHEDULE_DEFAULTS["other"]
    assert own.phase2_batch_size is None and own.max_predictions == 20
    small = fill_defaults(build_parser().parse_args(["--batch-size", "8"]))
    assert small.phase2_batch_size == 8  # phase 2 never takes larger batches than asked for
    assert fill_defaults(build_parser().parse_args(["--preset", "mini"])).phase2_steps == 0


def _sigterm_once(args: list[str], started, poll_s: float, to_group: bool, stop_within_s: float) -> tuple[int, str]:
    """`python -m training.pretrain args` in a session of its own, sent SIGTERM (to the trainer, or to the
    whole process group as GNU timeout, Slurm and systemd send it) once `started()` holds; its exit code
    and stderr, which it must give within `stop_within_s`."""
    import os
    import signal
    import time

    proc = subprocess.Popen([sys.executable, "-m", "training.pretrain", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    try:
        while not started() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(poll_s)
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        if to_group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=stop_within_s)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, err


def test_sigterm_while_the_data_is_prepared_stops_at_once(tmp_path):
    """Before the first step there is nothing to finish: SIGTERM to the job's process group stops the data
    preparation at once, as Ctrl-C does, with no checkpoint and no half-built data left (a run that went on
    would also wait forever on a preparation pool whose workers the same signal ended)."""
    corpus = write_corpus(tmp_path / "corpus.txt", n_docs=20000, seed=4)  # a few seconds of preparation
    cache = tmp_path / "cache"
    returncode, err = _sigterm_once(
        small_args(corpus, cache, tmp_path / "model", tmp_path / "run", "--max-steps", "100000"),
        started=cache.is_dir, poll_s=0.01, to_group=True, stop_within_s=60)  # the preparation has begun
    # 143, as a shell reports a process SIGTERM ended; no checkpoint to resume from: none is suggested
    assert returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == (f"interrupted before the first checkpoint in {tmp_path / 'run'}; run the "
                                            f"same command again to start over"), err
    assert "Traceback" not in err, err
    assert not list_checkpoints(tmp_path / "run") and not (tmp_path / "model").exists()
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]  # no half-built data


@pytest.mark.parametrize("to", ["process", "process group"])
def test_sigterm_stops_a_run_as_ctrl_c_does(to, tmp_path):
    """Schedulers and Kubernetes stop a job with SIGTERM: the run stops at the end of its step, with a
    checkpoint there to resume from, and the same line as Ctrl-C; no half-written model folder. GNU timeout,
    Slurm and systemd send it to every process of the job, the data workers included: they leave it to
    the trainer."""
    corpus = write_corpus(tmp_path / "corpus.txt", n_docs=80, seed=4)
    metrics = tmp_path / "run" / "metrics.jsonl"
    returncode, err = _sigterm_once(
        small_args(corpus, tmp_path / "cache", tmp_path / "model", tmp_path / "run", "--max-steps", "100000",
                   "--log-every", "1", "--data-workers", "2"),
        # training steps are being logged: the workers are running
        started=lambda: len(metrics.read_text().splitlines() if metrics.is_file() else []) >= 3,
        poll_s=0.05, to_group=to == "process group", stop_within_s=120)
    assert returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == "interrupted; continue with --resume", err
    assert "Traceback" not in err and "Exception" not in err, err
    assert not (tmp_path / "model").exists() and not list(tmp_path.glob(".model*"))
    steps = [r["step"] for r in read_metrics(tmp_path / "run")]
    newest = list_checkpoints(tmp_path / "run")[-1]
    assert int(newest.stem.split("-")[1]) == steps[-1]  # the step it stopped at: no work lost
