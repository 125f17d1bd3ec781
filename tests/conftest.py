"""Shared fixtures: a tiny real tokenizer + random-weight tiny BERT model folder, made once per session."""
from __future__ import annotations

import shutil
import signal
import tempfile
from pathlib import Path

import pytest
import torch

from training.model import BertForPreTraining, preset_config
from training.model_folder import save_model_folder
from training.wordpiece import save_tokenizer, train_wordpiece

SAMPLE_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "BERT is pretrained with masked language modelling and next sentence prediction.",
    "Embedding servers turn text into vectors for search and clustering.",
    "ONNX Runtime fuses attention, layer normalisation and GELU into single kernels.",
    "Dynamic batching packs queued requests up to a token budget to keep the device busy.",
    "Überraschung: naïve café résumé, 東京 and emoji 🚀 must tokenize without errors.",
] * 20


def _has_cuda() -> bool:
    try:
        import onnxruntime as ort
        return "CUDAExecutionProvider" in ort.get_available_providers() and torch.cuda.is_available()
    except Exception:
        return False


def pytest_configure(config):
    # Tests send Ctrl-C to the servers and runs they start. A test run started in the background (`&` in a
    # script, nohup) ignores SIGINT, and its children would inherit that: Ctrl-C as a terminal sends it.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    skips = {"gpu": None if _has_cuda() else "no CUDA device (with onnxruntime-gpu) on this machine",
             "torch_cuda": None if torch.cuda.is_available() else "no CUDA device for torch on this machine"}
    for item in items:
        for marker, reason in skips.items():
            if reason and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(train_wordpiece(SAMPLE_TEXT, vocab_size=300, min_frequency=1), out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer_dir):
    """A random-init tiny BertForPreTraining folder, exactly as training writes it."""
    torch.manual_seed(0)
    from tokenizers import Tokenizer
    vocab_size = Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json")).get_vocab_size()
    model = BertForPreTraining(preset_config("tiny", vocab_size=vocab_size, max_position_embeddings=128))
    return save_model_folder(model, tiny_tokenizer_dir, tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def tiny_artifact_dir(tmp_path_factory, tiny_model_dir):
    """tiny_model_dir exported on the CPU (fp32 + int8 graphs, tokenizer.json, manifest.json), as the
    server loads it. Read-only: copy it before changing anything in it."""
    from export.pipeline import export_artifact
    out = tmp_path_factory.mktemp("artifacts") / "tiny"
    export_artifact(tiny_model_dir, out, device="cpu", int8=True)
    return out


@pytest.fixture
def short_tmp_dir():
    """A fresh folder with a short path (under /tmp), for a TMPDIR whose Unix sockets must fit AF_UNIX's
    108 bytes; pytest's tmp_path can be longer (under xdist, much longer)."""
    folder = Path(tempfile.mkdtemp(prefix="bs-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)
