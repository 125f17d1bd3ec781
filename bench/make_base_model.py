"""A random-weight BERT-base model folder (vocabulary trained on the load generator's texts), for GPU
benchmarks that need an artifact to serve:  python bench/make_base_model.py OUT_DIR"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

import torch  # noqa: E402

from bench.http_load import make_texts  # noqa: E402
from training.model import BertForPreTraining, preset_config  # noqa: E402
from training.model_folder import save_model_folder  # noqa: E402
from training.wordpiece import save_tokenizer, train_wordpiece  # noqa: E402


def main(out: Path) -> None:
    texts = make_texts(5000, seed=1) + make_texts(5000, seed=2, min_words=1, max_words=3)
    tokenizer = train_wordpiece(texts, vocab_size=2000, min_frequency=1)
    save_tokenizer(tokenizer, out / "tokenizer")
    torch.manual_seed(0)
    model = BertForPreTraining(preset_config("base", vocab_size=tokenizer.get_vocab_size()))
    save_model_folder(model, out / "tokenizer", out / "model")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
