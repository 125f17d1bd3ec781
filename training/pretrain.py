"""`python -m training.pretrain`: prepare the data, pretrain BERT (MLM + NSP), write the model folder.

Defaults train the `tiny` preset on the embedded default corpus in about ten minutes on 2 CPU cores;
`--init-from DIR` continues any local BERT folder instead (its weights, shape and tokenizer).
Under `torchrun` it trains with DDP, one process per device; only rank 0 writes files.
"""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

import torch
from tokenizers import Tokenizer

from artifact.source_folder import TRAINING_SUMMARY_FILE, trained_max_length
from training.checkpoint import (CheckpointError, check_compatible, check_world_size, list_checkpoints,
                                 load_checkpoint, remove_stale_temporaries)
from training.corpus import CorpusError
from training.data import DataConfig, named_tokenizer, prepare_data
from training.ddp import DDPOptions
from training.model import PRESETS, BertConfig, BertForPreTraining, preset_config
from training.model_folder import (LoadedModel, ModelFolderError, load_model_folder, model_folder_entries,
                                   save_model_folder, sentence_transformers_files)
from training.trainer import (DistInfo, Phase, TrainConfig, barrier, check_config, phase_schedule,
                              setup_distributed, teardown_distributed, train)
from training.resume_checks import (RESUME_FIXED, RESUME_FIXED_IN_PHASE2, RESUME_TAKEN, absolute_path,
                                    check_corpus, check_corpus_contents, check_resume,
                                    check_same_out, check_tokenizer, comparable, corpus_contents, corpus_files,
                                    heldout_split_notice, paths_as_recorded_now)
from training.stop_signals import (exit_with, finishing, forget_caught_interrupt, interrupted_exit_code,
                                   sigterm_as_interrupt, sigterm_ends_the_process, sigterm_stops_between_steps)
from training.writes import (WriteError, check_model_out, check_out_free, check_run_dir_free, check_writable, out_held,
                             run_dir_held, settled_path)

# Peak learning rates that train each preset stably at the default batch; --lr overrides.
PRESET_LR = {"tiny": 2e-3, "mini": 1e-3, "small": 5e-4, "medium": 5e-4, "base": 1e-4, "large": 1e-4}
DEFAULT_PRESET = "tiny"
# --init-from's: the peak rate BERT itself was pretrained with; a trained model needs no larger step.
INIT_FROM_LR = 1e-4
DEFAULT_DROPOUT = 0.1  # a fresh model's (BERT's); --init-from keeps its folder's
DEFAULT_VOCAB_SIZE = DataConfig.vocab_size
# What a flag left out means. A run on the embedded corpus with the tiny preset is the `make run`
# demonstration, which must finish in about ten minutes on 2 CPU cores: short sequences in large batches
# and a small vocabulary reach the best held-out accuracy in that time (bench/default_model_sweep.py,
# BENCHMARKS.md), and a second phase at 128 tokens trains the positions the server then accepts.
SCHEDULE_DEFAULTS = {
    "demo": {"max_steps": 1100, "max_seq_len": 48, "batch_size": 192, "vocab_size": 4096,
             "phase2_steps": 900, "phase2_seq_len": 128},
    "other": {"max_steps": 1200, "max_seq_len": 128, "batch_size": TrainConfig.batch_size,
              "vocab_size": DEFAULT_VOCAB_SIZE, "phase2_steps": 0, "phase2_seq_len": 512},
}
# Every fresh model gets 512 positions (as BERT does), so phase 2 and the server's limit need no new model.
MAX_POSITIONS = 512
class _RankZeroFailed(Exception):
    """Another rank's copy of an error rank 0 already reported."""


# Under torchrun every process of a machine meets a refusal (a flag, a missing corpus) at about the same
# moment. Local rank 0 says it, once, and exits; torchrun then stops the others. They say theirs only if that
# stop has not come after this long: a refusal of theirs alone.
LOCAL_RANK_0_SAYS_S = 10.0


def _local_rank_0() -> bool:
    """Whether this process speaks for its machine: one process, or torchrun's first on each machine."""
    return int(os.environ.get("WORLD_SIZE", "1")) == 1 or int(os.environ.get("LOCAL_RANK", "0")) == 0


def _leave_it_to_local_rank_0() -> None:
    if not _local_rank_0():
        time.sleep(LOCAL_RANK_0_SAYS_S)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        _leave_it_to_local_rank_0()  # the usage once, not once per process
        super().error(message)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Defaults in the help, except None and on/off switches: those flags say in words what happens when
    left out (a store_true flag is off unless given, a --no-X flag on)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        switch = action.nargs == 0 and isinstance(action.const, bool)  # store_true / store_false
        return action.help if action.default in (None, []) or switch else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    d, t = DataConfig(), TrainConfig()
    p = _Parser(
        prog="python -m training.pretrain",
        description="Pretrain BERT (masked LM + next-sentence prediction) on your text and write a model "
                    "folder (config.json, model.safetensors, tokenizer files) that `python -m export` and "
                    "transformers read. *The demonstration: with no --corpus, --preset or --init-from, the tiny "
                    "preset on the embedded default corpus with a schedule that fits about ten minutes on 2 CPU "
                    "cores (what `make run` trains).",
        formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("data")
    g.add_argument("--corpus", nargs="+", default=[], metavar="PATH",
                   help=".txt (one sentence/paragraph per line, blank line between documents) or .jsonl "
                        "(--text-field) files, either also .gz, folders or globs; none: the embedded default corpus")
    g.add_argument("--text-field", default=d.text_field, metavar="NAME",
                   help="the field of each .jsonl line that holds its document's text")
    g.add_argument("--max-seq-len", type=int, default=None,
                   help="tokens per training sequence (default: 48 for the demonstration*, 128 otherwise)")
    g.add_argument("--max-predictions", type=int, default=None,
                   help="most masked tokens per sequence (default: BERT's 20 per 128 tokens, rounded up)")
    g.add_argument("--masked-lm-prob", type=float, default=d.masked_lm_prob, help="share of tokens masked")
    g.add_argument("--whole-word-masking", action="store_true", help="mask all pieces of a word together")
    g.add_argument("--vocab-size", type=int, default=None,
                   help=f"WordPiece vocabulary to train (default: 4096 for the demonstration*, "
                        f"{DEFAULT_VOCAB_SIZE} otherwise)")
    g.add_argument("--vocab-file", default=None, help="use this vocab.txt instead of training a tokenizer")
    g.add_argument("--no-lowercase", action="store_true", help="keep case (a cased model)")
    g.add_argument("--heldout-fraction", type=float, default=d.heldout_fraction,
                   help="share of documents held out for evaluation; their sentences that training documents "
                        "also hold are left out of it")
    g.add_argument("--cache-dir", default=d.cache_dir, help="where prepared data is cached")
    g.add_argument("--no-nsp-balance", action="store_true",
                   help="keep the original's NSP label rates (short documents give mostly NotNext) instead of "
                        "dropping surplus pairs so that exactly half are IsNext")

    g = p.add_argument_group("model")
    g.add_argument("--preset", default=None,
                   help=f"model size: {', '.join(PRESETS)} (default: {DEFAULT_PRESET}; with --init-from, the folder's)")
    g.add_argument("--init-from", default=None, metavar="DIR",
                   help="continue pretraining this local BERT folder (ours, transformers' BertForPreTraining or "
                        "BertModel, or sentence-transformers): its weights, sizes and tokenizer as they are; "
                        "heads it lacks start fresh")
    g.add_argument("--dropout", type=float, default=None,
                   help=f"hidden and attention dropout (default: {DEFAULT_DROPOUT} as in BERT; with --init-from, "
                        f"the folder's)")

    g = p.add_argument_group("optimisation")
    g.add_argument("--max-steps", type=int, default=None,
                   help="optimiser steps of phase 1 (default: 1100 for the demonstration*, 1200 otherwise)")
    g.add_argument("--batch-size", type=int, default=None,
                   help="sequences per micro-batch per process; the effective batch is this x --grad-accum x "
                        f"processes (default: 192 for the demonstration*, {t.batch_size} otherwise)")
    g.add_argument("--grad-accum", type=int, default=t.grad_accum, help="micro-batches per optimiser step")
    g.add_argument("--lr", type=float, default=None,
                   help="peak learning rate (default per preset: "
                        + ", ".join(f"{k} {v:g}" for k, v in PRESET_LR.items())
                        + f"; with --init-from {INIT_FROM_LR:g})")
    g.add_argument("--warmup-steps", type=int, default=None,
                   help="linear warm-up steps (default: --warmup-fraction of all steps)")
    g.add_argument("--warmup-fraction", type=float, default=t.warmup_fraction,
                   help="warm-up as a share of all steps, when --warmup-steps is not given")
    g.add_argument("--weight-decay", type=float, default=t.weight_decay,
                   help="AdamW weight decay (never on biases and LayerNorm weights)")
    g.add_argument("--clip-norm", type=float, default=t.clip_norm, help="gradient clipping norm; 0: off")
    g.add_argument("--seed", type=int, default=t.seed, help="seed of weights, data order, masks and dropout")
    g.add_argument("--phase2-steps", type=int, default=None,
                   help="steps of a second phase at --phase2-seq-len, as in the BERT paper; 0: none (default: "
                        "900 for the demonstration*, 0 otherwise)")
    g.add_argument("--phase2-seq-len", type=int, default=None,
                   help="sequence length of phase 2 (default: 128 for the demonstration*, 512 otherwise)")
    g.add_argument("--phase2-max-predictions", type=int, default=None,
                   help="most masked tokens per sequence in phase 2 (default: 20 per 128 tokens, rounded up)")
    g.add_argument("--phase2-batch-size", type=int, default=None,
                   help="micro-batch of phase 2 (default: --batch-size; at most 32 for the demonstration*)")

    g = p.add_argument_group("run")
    g.add_argument("--out", default="models/default", help="model folder to write at the end")
    g.add_argument("--run-dir", default=None,
                   help="checkpoints and metrics.jsonl (default: runs/<name of --out>)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in --run-dir (starts fresh if there is none); flags are "
                        "not read from it: pass the same values again (another value of one its state was made "
                        "under is refused; README)")
    g.add_argument("--fresh", action="store_true",
                   help="delete the checkpoints and metrics already in --run-dir and start over")
    g.add_argument("--eval-every", type=int, default=400, help="held-out evaluation every N steps; 0: at the end only")
    g.add_argument("--eval-batches", type=int, default=t.eval_batches, help="held-out batches per evaluation")
    g.add_argument("--checkpoint-every", type=int, default=400, help="checkpoint every N steps (and at the end)")
    g.add_argument("--keep-checkpoints", type=int, default=t.keep_checkpoints,
                   help="newest checkpoints kept (0: every one)")
    g.add_argument("--log-every", type=int, default=t.log_every, help="a metrics line every N steps")
    g.add_argument("--no-progress", action="store_true",
                   help="no progress bars; the training's loss still gets a line at each log step, and data "
                        "preparation a line a minute")

    g = p.add_argument_group("hardware")
    g.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    g.add_argument("--precision", default=t.precision, choices=("auto", "fp32", "bf16"),
                   help="auto: bf16 autocast on GPU, fp32 on CPU")
    g.add_argument("--compile", action="store_true", help="torch.compile the model (GPU: faster after warm-up)")
    g.add_argument("--cuda-graphs", action="store_true",
                   help="with --compile on a GPU: replay each step from a CUDA graph (one per token count; "
                        "batches are filled up to a multiple of 256 tokens), so that no launch work is left "
                        "on the CPU")
    g.add_argument("--no-unpad", dest="unpad", action="store_false",
                   help="run the encoder on padded batches (default: on real tokens only, padding removed)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's choice)")
    g.add_argument("--data-workers", type=int, default=t.data_workers,
                   help="processes per training process that build the next batches while it trains; "
                        "0: build each batch in the training process, between steps (default: on a GPU half the "
                        "process's share of the cores, 2 to 8; on a CPU 2)")

    g = p.add_argument_group("distributed (under torchrun; bench/ddp_scaling.py measures each)")
    g.add_argument("--ddp-bf16-grads", action="store_true",
                   help="all-reduce gradients in bf16: half the bytes between devices, but the averaged gradient is "
                        "rounded to bf16, so results differ slightly from the default fp32 all-reduce")
    g.add_argument("--ddp-bucket-mb", type=float, default=None, metavar="MB",
                   help="MB of gradients per all-reduce: larger buckets mean fewer all-reduces (and, with --compile, "
                        "fewer graph pieces) but less overlap with the backward pass (default: torch's, 25)")
    g.add_argument("--no-ddp-bucket-view", dest="ddp_bucket_view", action="store_false",
                   help="copy gradients back out of DDP's all-reduce buckets instead of keeping them as views into "
                        "the buckets, which gives the same numbers with one copy and one gradient-sized buffer less")
    g.add_argument("--ddp-static-graph", action="store_true",
                   help="let DDP assume every step uses every parameter in the same order (true of this model); "
                        "not with --grad-accum above 1")
    g.add_argument("--ddp-graph-per-bucket", action="store_true",
                   help="with --compile, split the compiled model at DDP's bucket boundaries (torch's default), so "
                        "that all-reduces overlap the backward pass; measured slower on two H100s (default: one graph, "
                        "all-reduces after the backward pass)")
    return p


@dataclass
class ModelSource:
    """Where a run's model comes from: a fresh preset, or the BERT folder given to --init-from (its
    weights, shape and tokenizer; heads it lacks freshly initialised)."""

    preset: str | None = None
    init_from: LoadedModel | None = None
    trained_length: int = 0  # the longest sequence the --init-from folder was trained at
    given: str | None = None  # --init-from as given, absolute: a sentence-transformers folder, not its Transformer's

    @property
    def name(self) -> str:
        return self.preset if self.init_from is None else str(self.init_from.folder)

    @property
    def max_positions(self) -> int:
        return MAX_POSITIONS if self.init_from is None else self.init_from.config.max_position_embeddings

    @property
    def folder(self) -> str | None:
        """The --init-from folder (where its transformer and tokenizer are), absolute."""
        return None if self.init_from is None else str(self.init_from.folder.resolve())

    @property
    def default_lr(self) -> float:
        return PRESET_LR[self.preset] if self.init_from is None else INIT_FROM_LR

    def dropout(self, given: float | None) -> float:
        """--dropout, or what leaving it out means: BERT's for a fresh model, the folder's with --init-from."""
        if given is not None:
            return given
        return DEFAULT_DROPOUT if self.init_from is None else self.init_from.config.hidden_dropout_prob

    def record(self) -> dict[str, Any]:
        """What checkpoints keep of it, so that a resume from another source is refused: the folder given,
        whose Pooling, Dense and Normalize modules the model folder keeps, not the one its weights are in."""
        return {"init_from": self.given}

    def model_config(self, vocab_size: int, dropout: float | None) -> BertConfig:
        if self.init_from is None:
            config = preset_config(self.preset, vocab_size=vocab_size, max_position_embeddings=MAX_POSITIONS)
            dropout = DEFAULT_DROPOUT if dropout is None else dropout
        else:
            config = self.init_from.config
        if dropout is None:
            return config
        return replace(config, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)

    def build(self, config: BertConfig, seed: int) -> BertForPreTraining:
        if self.init_from is not None and config == self.init_from.config:
            return self.init_from.model
        torch.manual_seed(seed)  # the same initial weights on every rank
        model = BertForPreTraining(config)
        if self.init_from is not None:  # another dropout: the modules are built from the config
            model.load_state_dict(self.init_from.model.state_dict())
        return model


def model_source(args: argparse.Namespace) -> ModelSource:
    """The fresh preset, or the --init-from folder, loaded and checked against the flags that would
    contradict it. Its missing heads are drawn from the seed, so every DDP rank gets the same."""
    if args.init_from is None:
        return ModelSource(preset=args.preset or DEFAULT_PRESET)
    for flag, given in (("--vocab-size", args.vocab_size is not None), ("--vocab-file", args.vocab_file is not None),
                        ("--no-lowercase", args.no_lowercase)):
        if given:
            raise ValueError(f"{flag} does not go with --init-from: the folder's tokenizer is used as it is")
    torch.manual_seed(args.seed)
    loaded = load_model_folder(args.init_from)
    c = loaded.config
    shape = (c.num_hidden_layers, c.hidden_size, c.num_attention_heads)
    if args.preset is not None and (PRESETS[args.preset] != shape or c.intermediate_size != 4 * c.hidden_size):
        layers, hidden, heads = PRESETS[args.preset]
        raise ValueError(f"--preset {args.preset} ({layers} layers, hidden {hidden}, {heads} heads) is not the shape "
                         f"of --init-from {args.init_from} ({shape[0]} layers, hidden {shape[1]}, {shape[2]} heads, "
                         f"FFN {c.intermediate_size}); leave --preset out")
    return ModelSource(init_from=loaded, trained_length=trained_max_length(args.init_from),
                       given=absolute_path(args.init_from))


def check_lengths(args: argparse.Namespace, source: ModelSource) -> None:
    lengths = [("--max-seq-len", args.max_seq_len)] + ([("--phase2-seq-len", args.phase2_seq_len)]
                                                       if args.phase2_steps else [])
    for flag, value in lengths:
        if value > source.max_positions:
            where = (f"--init-from {args.init_from} has" if source.init_from is not None
                     else "a fresh model gets")
            raise ValueError(f"{flag} {value} is longer than the {source.max_positions} positions {where}")


def data_configs(args: argparse.Namespace, tokenizer_dir: str | None = None) -> list[DataConfig]:
    phase1 = DataConfig(
        # the files it names (absolute, in reading order), not how it was spelt: checkpoints record and compare
        # these, so that a run resumes with the folder, a glob of it or the files, from any working folder
        corpus=tuple(corpus_files(args.corpus)),
        vocab_size=DEFAULT_VOCAB_SIZE if args.vocab_size is None else args.vocab_size,
        vocab_file=absolute_path(args.vocab_file),
        tokenizer_dir=tokenizer_dir, lowercase=not args.no_lowercase, max_seq_len=args.max_seq_len,
        masked_lm_prob=args.masked_lm_prob, max_predictions_per_seq=args.max_predictions,
        whole_word_masking=args.whole_word_masking,
        heldout_fraction=args.heldout_fraction, text_field=args.text_field, cache_dir=args.cache_dir,
        balance_nsp=not args.no_nsp_balance,
    )
    if args.phase2_steps <= 0:
        return [phase1]
    return [phase1, replace(phase1, max_seq_len=args.phase2_seq_len,
                            max_predictions_per_seq=args.phase2_max_predictions)]


def train_config(args: argparse.Namespace, default_lr: float) -> TrainConfig:
    return TrainConfig(
        batch_size=args.batch_size, grad_accum=args.grad_accum, lr=default_lr if args.lr is None else args.lr,
        warmup_steps=args.warmup_steps, warmup_fraction=args.warmup_fraction, weight_decay=args.weight_decay,
        clip_norm=args.clip_norm, seed=args.seed, log_every=args.log_every, eval_every=args.eval_every,
        eval_batches=args.eval_batches, checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints, precision=args.precision, compile=args.compile, unpad=args.unpad,
        cuda_graphs=args.cuda_graphs, data_workers=args.data_workers,
        ddp=DDPOptions(bf16_grads=args.ddp_bf16_grads, bucket_mb=args.ddp_bucket_mb, bucket_view=args.ddp_bucket_view,
                       static_graph=args.ddp_static_graph, graph_per_bucket=args.ddp_graph_per_bucket),
    )


def check_args(args: argparse.Namespace) -> None:
    if args.preset is not None and args.preset not in PRESETS:
        raise ValueError(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
    if args.max_steps < 1:
        raise ValueError(f"--max-steps must be at least 1, got {args.max_steps}")
    if args.phase2_steps < 0:
        raise ValueError(f"--phase2-steps must not be negative, got {args.phase2_steps}")
    for flag, value in (("--max-seq-len", args.max_seq_len), ("--phase2-seq-len", args.phase2_seq_len)):
        if value < 8:
            raise ValueError(f"{flag} must be at least 8 ([CLS] A [SEP] B [SEP]), got {value}")
    for flag, value, length, length_flag in (
            ("--max-predictions", args.max_predictions, args.max_seq_len, "--max-seq-len"),
            ("--phase2-max-predictions", args.phase2_max_predictions, args.phase2_seq_len, "--phase2-seq-len")):
        if not 1 <= value <= length - 3:  # masked positions are real tokens, never [CLS] or the two [SEP]s
            raise ValueError(f"{flag} must lie in [1, {length - 3}] at {length_flag} {length}, got {value}")
    if args.dropout is not None and not 0 <= args.dropout < 1:
        raise ValueError(f"--dropout must lie in [0, 1), got {args.dropout}")
    # given values are used as they are (a 0 is not "the default"): refuse the ones no run can use
    for flag, value, least in (("--lr", args.lr, "above 0"), ("--vocab-size", args.vocab_size, "at least 1"),
                               ("--phase2-batch-size", args.phase2_batch_size, "at least 1"),
                               ("--threads", args.threads, "at least 1")):
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{flag} must be {least}, got {value}")
    for flag, value in (("--weight-decay", args.weight_decay), ("--clip-norm", args.clip_norm)):
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"{flag} must be 0 or more, got {value}")
    if not 0 < args.heldout_fraction <= 0.5:  # (DataConfig takes 0 for evaluate's whole-corpus data)
        raise ValueError(f"--heldout-fraction must lie in (0, 0.5]: the run is evaluated on the documents it holds "
                         f"out, got {args.heldout_fraction}")
    if args.resume and args.fresh:
        raise ValueError("--resume and --fresh contradict each other; pass one")


def _rank0_first(dist: DistInfo, fn):
    """Run `fn` on rank 0 first (it builds the caches), then on the other ranks; an error on rank 0
    stops every rank instead of leaving them waiting at a barrier. The ranks wait for each other however
    long `fn` takes (dist.waits)."""
    if not dist.distributed:
        return fn()
    failure: list[str | None] = [None]
    result = None
    if dist.is_main:
        try:
            result = fn()
        except Exception as e:
            failure[0] = f"{type(e).__name__}: {e}"
            torch.distributed.broadcast_object_list(failure, src=0, group=dist.waits)
            raise
    torch.distributed.broadcast_object_list(failure, src=0, group=dist.waits)
    if not dist.is_main:
        if failure[0] is not None:
            raise _RankZeroFailed(failure[0])
        result = fn()
    torch.distributed.barrier(group=dist.waits)
    return result


def _check_same_checkpoint(dist: DistInfo, newest: Path | None) -> None:
    """Refuse, on every rank, to resume where the ranks' own --run-dir (copies, on machines that share no
    storage) hold other newest checkpoints: a rank restoring another step would train from other weights and
    data, then wait forever for steps its peers never take."""
    names: list[str | None] = [None] * dist.world_size
    torch.distributed.all_gather_object(names, None if newest is None else newest.name, group=dist.waits)
    if len(set(names)) > 1:
        ranks: dict[str, list[str]] = {}
        for rank, name in enumerate(names):
            ranks.setdefault(name or "none", []).append(str(rank))
        found = "; ".join(f"{name} on rank{'s' if len(r) > 1 else ''} {', '.join(r)}" for name, r in ranks.items())
        raise CheckpointError(f"the ranks' --run-dir hold other newest checkpoints ({found}): copy rank 0's run "
                              f"folder to every machine before --resume")


def _versions() -> dict[str, str]:
    import numpy
    import tokenizers
    return {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
            "tokenizers": tokenizers.__version__}


def run_dir_of(args: argparse.Namespace) -> Path:
    return Path(args.run_dir or Path("runs") / Path(args.out).name)


def _check_free(out: Path, run_dir: Path) -> None:
    check_out_free(out)
    check_run_dir_free(run_dir)


def _hold(held: contextlib.ExitStack, out: Path, run_dir: Path) -> None:
    held.enter_context(out_held(out))
    held.enter_context(run_dir_held(run_dir))


def _short_split_fix(split: str, kept: int, needed: int, world_size: int, heldout_documents: int, documents: int,
                     batch_flag: str) -> str:
    """What makes a split of `kept` sequence pairs hold one batch of `needed`, with the figures: the largest
    batch it holds; for the held-out split, the --heldout-fraction that holds about enough documents at its
    pairs per document (split_documents holds out round(documents x fraction), 2 at least), where one of
    0.5 or less would."""
    fixes = ["add text"]
    if kept >= world_size:
        fixes.append(f"pass {batch_flag} {kept // world_size} or less")
    if split == "training":
        fixes.append("lower --heldout-fraction")
    elif kept:
        wanted = math.ceil(needed * heldout_documents / kept) / documents
        if wanted <= 0.5:
            fixes.append(f"raise --heldout-fraction to {min(0.5, math.ceil(wanted * 100) / 100):g}")
    return fixes[0] if len(fixes) == 1 else ", ".join(fixes[:-1]) + (", or " if len(fixes) > 2 else " or ") + fixes[-1]


def _recorded_out(checkpoint: Path) -> str | None:
    """The --out whose run wrote `checkpoint`, as it recorded it; None where that cannot be read (an older or
    corrupt checkpoint: --fresh deletes it, and --resume says what is wrong with it)."""
    try:
        return load_checkpoint(checkpoint).get("out")
    except CheckpointError:
        return None


def run(args: argparse.Namespace, dist: DistInfo) -> dict[str, Any]:
    with contextlib.ExitStack() as held:  # --out and --run-dir, from their checks to the end of the run
        return _run(args, dist, held)


def _run(args: argparse.Namespace, dist: DistInfo, held: contextlib.ExitStack) -> dict[str, Any]:
    out, run_dir = Path(args.out), run_dir_of(args)
    source = model_source(args)
    if source.init_from is not None and source.init_from.untied_mlm_decoder and dist.is_main:
        print(f"notice: --init-from {args.init_from} has an MLM decoder of its own (tie_word_embeddings false); this "
              f"project's BERT ties it to the word embeddings, so masked-LM training starts from them there and "
              f"relearns the head", flush=True)
    check_lengths(args, source)
    cfg = train_config(args, source.default_lr)
    check_config(cfg, dist)
    dcfgs = data_configs(args, source.folder)
    flags = resume_flags(args, source, cfg)

    # Decide how the run starts before spending time on data: a wrong checkpoint or a folder that
    # cannot be written fails fast.
    check_model_out(out, args.init_from, model_folder_entries(out),
                    {"--run-dir": [run_dir], "--cache-dir": [args.cache_dir], "--corpus": args.corpus})
    check_writable(out, "--out", replaced_whole=True)  # on every rank: one refused alone would leave the others waiting
    check_writable(run_dir, "--run-dir")
    _rank0_first(dist, lambda: _check_free(out, run_dir) if dist.is_main else None)  # before run_dir's files are read
    existing = list_checkpoints(run_dir)
    if existing and args.run_dir is None and not args.resume:  # --resume checks it below, from the state it loads
        # the default run folder may be another --out's of the same name: --fresh would delete its run
        check_same_out(existing[-1], _recorded_out(existing[-1]), out)
    if existing and not args.resume and not args.fresh:
        raise CheckpointError(f"{run_dir} holds checkpoints of an earlier run (newest {existing[-1].name}); "
                              f"pass --resume to continue it, --fresh to start over, or another --run-dir")
    resume_from = existing[-1] if args.resume and existing else None
    if args.resume and dist.distributed:
        _check_same_checkpoint(dist, resume_from)
    resume_state = paths_as_recorded_now(load_checkpoint(resume_from)) if resume_from is not None else None
    corpus_now = corpus_contents(dcfgs[0].corpus)  # recorded in the checkpoints, compared by --resume
    trained_with = None  # the tokenizer whose ids the checkpoint's weights learnt (unknown to an older checkpoint)
    named = None  # with it: the one --vocab-file or --init-from gives; None: one trained on the corpus
    if resume_state is not None:
        if args.run_dir is None:  # the default, runs/<--out's name>: another --out of that name may own it
            check_same_out(resume_from, resume_state.get("out"), out)
        check_world_size(resume_from, resume_state, dist.world_size)  # before hours of data preparation
        check_corpus(resume_from, resume_state["data_config"]["corpus"], dcfgs[0].corpus)
        check_corpus_contents(resume_from, resume_state.get("corpus_contents"), corpus_now, dcfgs[0].corpus)
        split_notice = heldout_split_notice(resume_from, resume_state)
        changes = check_resume(resume_from, resume_state, flags)
        check_compatible(resume_from, resume_state, {"model_source": source.record(),
                                                     "data_config": comparable(dcfgs[0])})
        for line in (split_notice, changes):
            if line and dist.is_main:
                print(line, flush=True)
        if "tokenizer" in resume_state:
            trained_with = Tokenizer.from_str(resume_state["tokenizer"])
            named = named_tokenizer(dcfgs[0])
            if named is not None:  # a changed --vocab-file or --init-from: refused before the data is prepared
                check_tokenizer(resume_from, trained_with, named, dcfgs[0])

    # The checks above only read. Rank 0 writes the run's files and the model: from here on it holds --out
    # and --run-dir, and a refusal there (another training to either) stops every rank.
    _rank0_first(dist, lambda: _hold(held, out, run_dir) if dist.is_main else None)
    if dist.is_main:
        remove_stale_temporaries(run_dir)
        if args.fresh:
            for path in existing:
                path.unlink(missing_ok=True)  # and metrics.jsonl starts over with step 0 (MetricsLog)
    barrier(dist)

    started = time.perf_counter()
    # No step to finish yet: SIGTERM stops the preparation at once, as Ctrl-C does. Sent to the whole group,
    # it also ends the preparation's own worker processes, whose work a pool would otherwise wait for forever.
    # Under DDP the other ranks wait for rank 0 inside a collective call, where no handler runs: the default.
    with sigterm_as_interrupt() if not dist.distributed else sigterm_ends_the_process():
        prepared = [_rank0_first(dist, lambda c=c: prepare_data(c, rank=dist.rank, world_size=dist.world_size,
                                                                show_progress=dist.is_main and not args.no_progress,
                                                                progress_lines=dist.is_main, trained=trained_with))
                    for c in dcfgs]
    prepare_s = time.perf_counter() - started
    if trained_with is not None and named is None:  # a cache another run prepared with a tokenizer of its own
        check_tokenizer(resume_from, trained_with, prepared[0].tokenizer, dcfgs[0], prepared[0].stats["cache"])
    vocab_size = prepared[0].tokenizer.get_vocab_size()
    if len(prepared) > 1 and prepared[1].tokenizer.get_vocab() != prepared[0].tokenizer.get_vocab():
        raise ValueError("phase 2 data got another vocabulary than phase 1; pass --vocab-file to fix one")
    model_config = source.model_config(vocab_size, args.dropout)
    if vocab_size > model_config.vocab_size:
        raise ValueError(f"the tokenizer of {source.name} has {vocab_size} tokens but the model only "
                         f"{model_config.vocab_size} embeddings; tokenizer and weights do not belong together")
    meta = {
        "out": absolute_path(str(out)),  # whose run this is: see check_same_out
        "model_source": source.record(),
        "model_config": asdict(model_config),
        "data_config": comparable(dcfgs[0]),
        "corpus_contents": corpus_now,
        "phases_config": [comparable(c) for c in dcfgs[1:]],
        "train_config": asdict(cfg),
        "flags": flags,
        # the whole tokenizer, not only its fingerprint: a resume without this cache tokenises with it again
        "tokenizer": prepared[0].tokenizer.to_str(),
    }
    if resume_state is not None:
        check_compatible(resume_from, resume_state, {"model_config": meta["model_config"]})

    phase2_batch = phase2_batch_size(args)
    for i, (p, c) in enumerate(zip(prepared, dcfgs)):
        batch = args.batch_size if i == 0 else phase2_batch
        for split, data in (("training", p.train), ("held-out", p.heldout)):
            kept, needed = data.num_examples(0), batch * dist.world_size
            if kept >= needed:
                continue
            fix = _short_split_fix(split, kept, needed, dist.world_size, p.heldout.num_documents,
                                   p.train.num_documents + p.heldout.num_documents,
                                   "--batch-size" if i == 0 else "--phase2-batch-size")
            drawn = data.pairs_drawn
            if data.balance_nsp and drawn >= needed and kept * 4 < drawn:  # under 1 in 8 IsNext before balancing
                fix = (f"balancing the next-sentence labels kept {kept} of its {drawn}: few of its "
                       f"documents have the two sentences or more that an IsNext pair needs; give longer documents, "
                       f"or pass --no-nsp-balance")
            which, less = f"{split} split", p.stats["heldout_sentences_in_training"] if split == "held-out" else 0
            if less:  # a corpus of duplicates can leave little of it
                which += f", less its {less:,} sentences that training documents also hold,"
            raise ValueError(f"the {which} has {kept} sequence pairs at length {c.max_seq_len}, fewer than one "
                             f"batch of {batch} x {dist.world_size} processes; {fix}")
    phases = [Phase(name=f"phase{i + 1}", train=p.train, heldout=p.heldout,
                    steps=args.max_steps if i == 0 else args.phase2_steps, max_seq_len=c.max_seq_len,
                    max_predictions=c.max_predictions_per_seq,
                    batch_size=args.batch_size if i == 0 else phase2_batch)
              for i, (p, c) in enumerate(zip(prepared, dcfgs))]
    model = source.build(model_config, cfg.seed)
    if dist.is_main:
        n_params = sum(p.numel() for p in model.parameters())
        schedule = [phase_schedule(p, cfg, dist.world_size) for p in phases]
        if len(phases) > 1:
            schedule = [f"phase {i + 1}: {words}" for i, words in enumerate(schedule)]
        print(prepared[0].stats["heldout"], flush=True)
        print(f"training {source.name} ({n_params / 1e6:.1f}M parameters, vocabulary {vocab_size}) on {dist.device}"
              f" x{dist.world_size}: {', '.join(schedule)}; "
              f"{'resuming from ' + str(resume_from) if resume_from else 'checkpoints in ' + str(run_dir)}",
              flush=True)
    result = train(model, phases, cfg, dist, run_dir, checkpoint_meta=meta, resume_from=resume_from,
                   resume_state=resume_state, show_progress=not args.no_progress)
    del resume_state

    # The longest sequence the written model has been trained at, counting the --init-from folder's own.
    max_length = min(max([c.max_seq_len for c in dcfgs] + [source.trained_length]),
                     model_config.max_position_embeddings)
    summary = {
        "preset": source.preset,
        "init_from": source.given,
        "max_length": max_length,
        "model_config": model_config.to_hf_dict(),
        "train_config": asdict(cfg),
        "data_config": [comparable(c) for c in dcfgs],
        "data_stats": [p.stats for p in prepared],
        "phases": [{"name": ph.name, "steps": ph.steps, "max_seq_len": ph.max_seq_len,
                    "batch_size": ph.batch_size} for ph in phases],
        "steps": result.steps,
        "tokens_seen": result.tokens_seen,
        "wall_time_s": round(result.wall_time_s, 1),  # training, summed over resumed runs
        "data_preparation_s": round(prepare_s, 1),  # this invocation's (near 0 when cached)
        "world_size": dist.world_size,
        "device": str(dist.device) if dist.device.type == "cpu" else torch.cuda.get_device_name(dist.device),
        "heldout": result.final_eval,
        "versions": _versions(),
    }
    if dist.is_main:
        save_model_folder(model, prepared[0].tokenizer_dir, out, extra_files={TRAINING_SUMMARY_FILE: summary},
                          max_length=max_length,
                          copies=sentence_transformers_files(args.init_from) if args.init_from else None)
    barrier(dist)
    return summary


def resume_flags(args: argparse.Namespace, source: ModelSource, cfg: TrainConfig) -> dict[str, Any]:
    """The flags --resume compares (RESUME_*) with the values the run takes, where leaving one out means
    another flag's value or the model's; checkpoints record them."""
    given = {flag: getattr(args, flag[2:].replace("-", "_"))
             for flag in (*RESUME_FIXED, *RESUME_FIXED_IN_PHASE2, *RESUME_TAKEN)}
    return {**given, "--vocab-file": absolute_path(args.vocab_file), "--preset": source.preset,
            "--init-from": source.given, "--dropout": source.dropout(args.dropout),
            "--phase2-batch-size": phase2_batch_size(args), "--lr": cfg.lr}


def phase2_batch_size(args: argparse.Namespace) -> int:
    return args.batch_size if args.phase2_batch_size is None else args.phase2_batch_size


def summary_line(summary: dict[str, Any], out: Path) -> str:
    h = summary["heldout"]
    minutes, seconds = divmod(round(summary["wall_time_s"]), 60)
    return (f"done: {summary['steps']} steps, {summary['tokens_seen'] / 1e6:.2f}M tokens in {minutes}m{seconds:02d}s "
            f"(+{summary['data_preparation_s']:.0f}s data preparation); "
            f"held-out MLM accuracy {h['mlm_accuracy']:.3f} (most frequent token {h['mlm_baseline_accuracy']:.3f}), "
            f"NSP accuracy {h['nsp_accuracy']:.3f} (baseline {h['nsp_baseline_accuracy']:.3f}); model folder {out}")


def fill_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Give the flags left out their values: the demonstration's schedule for a fresh tiny model on the
    embedded corpus, the general one otherwise (SCHEDULE_DEFAULTS). --init-from keeps its tokenizer."""
    demo = not args.corpus and args.init_from is None and (args.preset or DEFAULT_PRESET) == "tiny"
    for name, value in SCHEDULE_DEFAULTS["demo" if demo else "other"].items():
        if getattr(args, name) is None and not (name == "vocab_size" and args.init_from is not None):
            setattr(args, name, value)
    if args.phase2_batch_size is None and demo:
        args.phase2_batch_size = min(32, args.batch_size)  # small steps at 128 tokens: 900 of them fit the ten minutes
    if args.max_predictions is None:
        args.max_predictions = predictions_for(args.max_seq_len)
    if args.phase2_max_predictions is None:
        args.phase2_max_predictions = predictions_for(args.phase2_seq_len)
    return args


def predictions_for(seq_len: int) -> int:
    """BERT's masked-position budget: 20 per 128 tokens (80 at 512), rounded up."""
    return -(-seq_len * 20 // 128)


def main(argv: list[str] | None = None) -> int:
    args = fill_defaults(build_parser().parse_args(argv))
    args.out = settled_path(args.out)  # `--out a/m/../m` would lose both models at the final rename
    dist = DistInfo()
    try:
        check_args(args)
        if args.threads:
            torch.set_num_threads(args.threads)
        dist = setup_distributed(args.device)
        # stop at a step's end, with a checkpoint there; under DDP the ranks agree on the step (the trainer)
        with sigterm_stops_between_steps():
            summary = run(args, dist)
    except _RankZeroFailed:
        return 2  # rank 0 printed it
    except (CorpusError, ModelFolderError, CheckpointError, WriteError, ValueError, FloatingPointError) as e:
        _leave_it_to_local_rank_0()
        print(f"error: {e}" if not dist.distributed else f"error (rank {dist.rank}): {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        forget_caught_interrupt()
        run_dir = run_dir_of(args)
        if _local_rank_0():  # torchrun passes the interrupt to every process
            print("interrupted; continue with --resume" if list_checkpoints(run_dir) else
                  f"interrupted before the first checkpoint in {run_dir}; run the same command again to start over",
                  file=sys.stderr)
        return interrupted_exit_code()
    finally:
        teardown_distributed()
    if dist.is_main:
        with finishing():  # the model folder is written
            print(summary_line(summary, Path(args.out)), flush=True)
    return 0


if __name__ == "__main__":
    exit_with(main())
