"""`python -m training.evaluate`: masked-LM and next-sentence accuracy and loss of a model folder (ours
or any transformers BertForPreTraining folder) on a corpus, beside the most-frequent-token and
majority baselines. Every document is evaluated; pairs and masks are built as in training
(training.data) from fixed seeds, so every run gives the same numbers.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from artifact.source_folder import trained_max_length
from training.corpus import CorpusError
from training.data import DataConfig, prepare_data
from training.model_folder import LoadedModel, ModelFolderError, load_model_folder
from training.trainer import pretraining_metrics, pretraining_sums

SEED = 0  # of the order and the masks (pairs have their own fixed seed in training.data)
MAX_DEFAULT_SEQ_LEN = 512  # --max-seq-len defaults to the model's trained length, at most this
MASKED_LM_PROB = DataConfig.masked_lm_prob


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m training.evaluate",
        description="Masked-LM and next-sentence accuracy and loss of a model folder on a corpus, beside the "
                    "most-frequent-token and majority-class baselines. Sentence pairs and masks are built as in "
                    "training, from fixed seeds: the same numbers on every run.",
    )
    p.add_argument("--model", required=True, metavar="DIR",
                   help="model folder with pretraining heads (ours, or a transformers BertForPreTraining folder)")
    p.add_argument("--corpus", nargs="+", required=True, metavar="PATH",
                   help=".txt (one sentence per line, blank line between documents) or .jsonl files, either also "
                        ".gz, folders or globs; all of it is the evaluation set")
    p.add_argument("--text-field", default=DataConfig.text_field, metavar="NAME",
                   help="the field of each .jsonl line that holds its document's text")
    p.add_argument("--max-seq-len", type=int, default=None,
                   help=f"tokens per sequence pair (default: the longest the model was trained at, at most "
                        f"{MAX_DEFAULT_SEQ_LEN})")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per forward pass")
    p.add_argument("--max-sequences", type=int, default=None,
                   help="evaluate this many sequence pairs only (a fixed random sample of them); default: all")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the model runs")
    p.add_argument("--cache-dir", default=DataConfig.cache_dir, help="where the tokenised corpus is cached")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout instead of the text block")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (there is none off a terminal)")
    return p


def require_heads(loaded: LoadedModel, folder: Path) -> None:
    """Evaluation reads both heads: a folder that lacks one would be scored on random weights."""
    missing = []
    if not loaded.has_mlm_head:
        missing.append("no MLM head (cls.predictions.*)")
    if not loaded.has_nsp_head:  # NSP reads the pooler too
        missing.append("no NSP head (cls.seq_relationship.*)" if loaded.has_pooler
                       else "no NSP head (bert.pooler.*, cls.seq_relationship.*)")
    if missing:
        raise ModelFolderError(f"{folder} has {' and '.join(missing)}: evaluation needs a BertForPreTraining "
                               f"checkpoint")
    if loaded.untied_mlm_decoder:  # ours would score with the word embeddings in its place
        raise ModelFolderError(f"{folder}'s MLM decoder is a weight of its own (tie_word_embeddings false), which "
                               f"this project's BERT ties to the word embeddings: its masked-LM figures would not be "
                               f"the checkpoint's")


def evaluate_folder(model_dir: Path | str, corpus: list[str], *, max_seq_len: int | None = None,
                    batch_size: int = 32, max_sequences: int | None = None, device: str = "cpu",
                    cache_dir: str = DataConfig.cache_dir, text_field: str = DataConfig.text_field,
                    show_progress: bool = False) -> dict[str, Any]:
    """The figures `python -m training.evaluate` prints, as a dict (see pretraining_metrics)."""
    if batch_size < 1 or (max_sequences is not None and max_sequences < 1):
        raise ValueError("--batch-size and --max-sequences must be at least 1")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but no CUDA device is visible; use --device cpu")
    loaded = load_model_folder(model_dir)
    require_heads(loaded, Path(model_dir))
    positions = loaded.config.max_position_embeddings
    max_seq_len = max_seq_len or min(trained_max_length(model_dir), MAX_DEFAULT_SEQ_LEN)
    if not 8 <= max_seq_len <= positions:
        raise ValueError(f"--max-seq-len must lie in [8, {positions}] (the model's positions), got {max_seq_len}")

    cfg = DataConfig(corpus=tuple(corpus), tokenizer_dir=str(loaded.folder.resolve()), max_seq_len=max_seq_len,
                     max_predictions_per_seq=math.ceil(MASKED_LM_PROB * max_seq_len), heldout_fraction=0.0,
                     text_field=text_field, cache_dir=cache_dir)
    data = prepare_data(cfg, show_progress=show_progress, progress_stream=sys.stderr)  # stdout: the figures alone
    if data.tokenizer.get_vocab_size() > loaded.config.vocab_size:
        raise ModelFolderError(f"{model_dir}: the tokenizer has {data.tokenizer.get_vocab_size()} tokens but the model "
                               f"only {loaded.config.vocab_size} embeddings; they do not belong together")
    dataset = data.train  # no held-out share: every document
    sequences = min(dataset.num_examples(0), max_sequences or dataset.num_examples(0))
    batches = tqdm(dataset.every_batch(0, batch_size, SEED, max_sequences), total=math.ceil(sequences / batch_size),
                   unit="batch", desc="evaluate", file=sys.stderr, disable=None if show_progress else True)
    dev = torch.device(device)
    sums = pretraining_sums(loaded.model.to(dev), batches, cfg.max_predictions_per_seq,
                            dataset.most_frequent_token_id(), dev)
    metrics = pretraining_metrics(sums, when_empty="the corpus yields no sentence pair (it needs documents of two "
                                                   "or more sentences)")
    return {"model": str(model_dir), "corpus": list(cfg.corpus), "documents": dataset.num_documents,
            "max_seq_len": max_seq_len, **metrics}


def report(r: dict[str, Any]) -> str:
    return "\n".join([
        f"model   {r['model']}",
        f"corpus  {', '.join(r['corpus'])}: {r['documents']:,} documents, {r['sequences']:,} sequence pairs of up to "
        f"{r['max_seq_len']} tokens, {r['masked_tokens']:,} masked tokens",
        f"MLM     accuracy {r['mlm_accuracy']:.4f}  loss {r['mlm_loss']:.4f}   "
        f"(most frequent token: accuracy {r['mlm_baseline_accuracy']:.4f})",
        f"NSP     accuracy {r['nsp_accuracy']:.4f}  loss {r['nsp_loss']:.4f}   "
        f"(majority class: accuracy {r['nsp_baseline_accuracy']:.4f})",
    ])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = evaluate_folder(args.model, args.corpus, max_seq_len=args.max_seq_len, batch_size=args.batch_size,
                                 max_sequences=args.max_sequences, device=args.device, cache_dir=args.cache_dir,
                                 text_field=args.text_field,
                                 show_progress=not args.no_progress and sys.stderr.isatty())
    except (ModelFolderError, CorpusError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else report(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
