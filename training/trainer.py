"""The pre-training loop: MLM + NSP steps with AdamW, warm-up/decay, clipping, accumulation, bf16
autocast on GPU, optional torch.compile and DDP; periodic held-out evaluation, metrics (JSONL) and
complete, exactly-resumable checkpoints. Data preparation and the command line live elsewhere
(`training.data`, `training.pretrain`); this module takes prepared datasets and a model."""
from __future__ import annotations

import contextlib
import functools
import itertools
import json
import math
import os
import random
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from training.batch_stream import BatchSource, BatchStream
from training.checkpoint import FORMAT_VERSION, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from training.model import BertForPreTraining
from training.model_inputs import cpu_inputs, inputs_to_device, model_inputs
from training.optim import WarmupLinearDecay, make_optimizer


@dataclass(frozen=True)
class TrainConfig:
    batch_size: int = 32  # sequences per micro-batch per process
    grad_accum: int = 1  # micro-batches per optimiser step
    lr: float = 1e-3
    warmup_steps: int | None = None  # None: warmup_fraction of all steps
    warmup_fraction: float = 0.06
    weight_decay: float = 0.01
    clip_norm: float = 1.0  # 0 turns clipping off
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0  # 0: only at the end
    eval_batches: int = 20
    checkpoint_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 2
    precision: str = "auto"  # auto | fp32 | bf16
    compile: bool = False
    unpad: bool = True  # run the encoder on real tokens only (training.packed)
    # Processes that build the next training batches during the step (0: in the step). None: 4 on a GPU,
    # where a base step takes ~36 ms and one batch of 256 ~60-100 ms of CPU; 2 on a CPU.
    data_workers: int | None = None

    def __post_init__(self) -> None:
        for name in ("batch_size", "grad_accum", "log_every", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("eval_every", "checkpoint_every", "keep_checkpoints", "data_workers"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must not be negative, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ValueError(f"--warmup-steps must not be negative, got {self.warmup_steps}")
        if not 0 <= self.warmup_fraction <= 1:
            raise ValueError(f"--warmup-fraction must lie in [0, 1], got {self.warmup_fraction}")
        if self.precision not in ("auto", "fp32", "bf16"):
            raise ValueError(f"--precision must be auto, fp32 or bf16, got {self.precision!r}")


@dataclass
class Phase:
    """A stretch of training on one prepared dataset (phase 2 of BERT: longer sequences)."""

    name: str
    train: BatchSource
    heldout: BatchSource
    steps: int  # optimiser steps
    max_seq_len: int
    max_predictions: int  # masked positions per sequence: the fixed width of the MLM gather
    batch_size: int


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def setup_distributed(device: str = "auto") -> DistInfo:
    """One process per device. Under `torchrun` (RANK / WORLD_SIZE / LOCAL_RANK set) this joins the
    process group: NCCL on GPUs, gloo on CPUs."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError("--device cuda was asked for but no CUDA device is visible; use --device cpu")
        dev = torch.device("cuda", local_rank) if world_size > 1 or device == "cuda" else torch.device(device)
        torch.cuda.set_device(dev)
    elif device == "cpu":
        dev = torch.device("cpu")
    else:
        raise ValueError(f"--device must be auto, cpu or cuda, got {device!r}")
    if world_size > 1 and not torch_dist.is_initialized():
        torch_dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return DistInfo(rank, world_size, local_rank, dev)


def teardown_distributed() -> None:
    if torch_dist.is_initialized():
        torch_dist.destroy_process_group()


def barrier(dist: DistInfo) -> None:
    if dist.distributed:
        torch_dist.barrier()


def autocast_context(precision: str, device: torch.device):
    """bf16 autocast on GPU by default, plain fp32 on CPU (bf16 matmuls on CPUs are rarely faster)."""
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def evaluate(model: BertForPreTraining, data: BatchSource, phase: Phase, cfg: TrainConfig, dist: DistInfo,
             most_frequent_id: int) -> dict[str, float]:
    """Held-out MLM / NSP loss and accuracy on the first `cfg.eval_batches` batches (the same masks
    every time: fixed seed and epoch), summed over all processes; with the baselines beside them."""
    batches = data.batches(0, phase.batch_size, cfg.seed, rank=dist.rank, world_size=dist.world_size)
    sums = pretraining_sums(model, itertools.islice(batches, cfg.eval_batches), phase.max_predictions,
                            most_frequent_id, dist.device, cfg.precision, cfg.unpad)
    if dist.distributed:
        torch_dist.all_reduce(sums)
    return pretraining_metrics(sums, when_empty="the held-out split yields no batch; use a larger corpus, a larger "
                                                "--heldout-fraction or a smaller --batch-size")


@torch.no_grad()
def pretraining_sums(model: BertForPreTraining, batches: Iterable[dict[str, torch.Tensor]], max_predictions: int,
                     most_frequent_id: int, device: torch.device, precision: str = "fp32",
                     unpad: bool = True) -> torch.Tensor:
    """The running sums behind pretraining_metrics over `batches` (from the data pipeline), float64 [8]
    on `device`, so that processes can add theirs up before the division."""
    was_training = model.training
    model.eval()
    # mlm loss sum, mlm correct, mlm count, most-frequent-token correct, nsp loss sum, nsp correct, nsp count, IsNext count
    sums = torch.zeros(8, dtype=torch.float64, device=device)
    for batch in batches:
        inputs = model_inputs(batch, max_predictions, device, unpad=unpad)
        with autocast_context(precision, device):
            out = model(**inputs)
        labels = inputs["mlm_labels"].flatten()
        keep = labels != -100
        mlm_logits = out.mlm_logits.float()[keep]
        labels = labels[keep]
        nsp_logits, nsp = out.nsp_logits.float(), inputs["nsp_labels"]
        sums += torch.stack([
            F.cross_entropy(mlm_logits, labels, reduction="sum").double(),
            (mlm_logits.argmax(-1) == labels).sum().double(),
            torch.tensor(labels.numel(), dtype=torch.float64, device=device),
            (labels == most_frequent_id).sum().double(),
            F.cross_entropy(nsp_logits, nsp, reduction="sum").double(),
            (nsp_logits.argmax(-1) == nsp).sum().double(),
            torch.tensor(nsp.numel(), dtype=torch.float64, device=device),
            (nsp == 0).sum().double(),
        ])
    model.train(was_training)
    return sums


def pretraining_metrics(sums: torch.Tensor, when_empty: str) -> dict[str, float]:
    """MLM / NSP loss and accuracy from pretraining_sums, with the baselines beside them; a ValueError
    saying `when_empty` if the sums cover no sequence."""
    mlm_loss, mlm_ok, mlm_n, mf_ok, nsp_loss, nsp_ok, nsp_n, is_next = sums.tolist()
    if mlm_n == 0 or nsp_n == 0:
        raise ValueError(when_empty)
    return {
        "mlm_loss": mlm_loss / mlm_n,
        "mlm_accuracy": mlm_ok / mlm_n,
        "mlm_baseline_accuracy": mf_ok / mlm_n,  # always predict the most frequent token
        "nsp_loss": nsp_loss / nsp_n,
        "nsp_accuracy": nsp_ok / nsp_n,
        "nsp_baseline_accuracy": max(is_next, nsp_n - is_next) / nsp_n,  # always predict the majority class
        "masked_tokens": int(mlm_n),
        "sequences": int(nsp_n),
    }


class MetricsLog:
    """One JSON object per line in `metrics.jsonl` (main process only); appended to on resume."""

    def __init__(self, path: Path | None):
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n")


@dataclass
class TrainResult:
    steps: int
    tokens_seen: int  # non-padding tokens, all processes
    wall_time_s: float  # this process's training time, summed over resumed runs
    final_eval: dict[str, float]
    evals: list[dict[str, Any]] = field(default_factory=list)


def train(
    model: BertForPreTraining,
    phases: list[Phase],
    cfg: TrainConfig,
    dist: DistInfo,
    run_dir: Path,
    *,
    checkpoint_meta: dict[str, Any],
    resume_from: Path | None = None,
    resume_state: dict[str, Any] | None = None,
    show_progress: bool = True,
) -> TrainResult:
    """Train `model` through `phases` (one learning-rate schedule over all of them).

    `checkpoint_meta` (model / data / train configuration) goes into every checkpoint so that a
    resume can be checked against it; `resume_from` (and its already loaded `resume_state`, if the
    caller has it) continues from that checkpoint exactly."""
    device = dist.device
    torch.backends.cuda.matmul.allow_tf32 = True  # only matters for fp32 on GPU
    torch.backends.cudnn.allow_tf32 = True
    model.to(device).train()
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, device)
    total_steps = sum(p.steps for p in phases)
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else round(cfg.warmup_fraction * total_steps)
    schedule = WarmupLinearDecay(optimizer, cfg.lr, min(warmup, total_steps), total_steps)

    step, phase_idx, epoch, batch_in_epoch, tokens_seen, wall_before = 0, 0, 0, 0, 0, 0.0
    evals: list[dict[str, Any]] = []
    if resume_from is not None:
        state = resume_state if resume_state is not None else load_checkpoint(resume_from)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        step, phase_idx, epoch, batch_in_epoch = state["step"], state["phase"], state["epoch"], state["batch_in_epoch"]
        tokens_seen, wall_before = state["tokens_seen"], state["wall_time_s"]
        if len(state["rng"]) != dist.world_size:
            raise ValueError(f"checkpoint {resume_from} was written by {len(state['rng'])} processes; "
                             f"resume with the same number (now {dist.world_size})")
        set_rng_state(state["rng"][dist.rank], device)
    else:
        # Same weights on every rank come from the seed; dropout differs per rank.
        _seed_everything(cfg.seed + dist.rank)

    ddp_model: nn.Module = model
    if dist.distributed:
        ddp_model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None)
    step_model = torch.compile(ddp_model) if cfg.compile else ddp_model

    metrics = MetricsLog(Path(run_dir) / "metrics.jsonl" if dist.is_main else None)
    if dist.is_main:
        metrics.write("start", step=step, total_steps=total_steps, world_size=dist.world_size,
                      device=str(device), resumed_from=str(resume_from) if resume_from else None,
                      effective_batch=phases[min(phase_idx, len(phases) - 1)].batch_size * cfg.grad_accum * dist.world_size)

    start_time = time.perf_counter()
    most_frequent = phases[0].train.most_frequent_token_id()
    # disable=None: a bar on a terminal only; elsewhere (a log file) plain lines at each log step.
    progress = tqdm(total=total_steps, initial=step, disable=None if show_progress and dist.is_main else True,
                    unit="step", dynamic_ncols=True, desc="pretrain")
    plain_lines = show_progress and dist.is_main and progress.disable
    last_eval: dict[str, Any] | None = None

    def run_eval(phase: Phase) -> dict[str, Any]:
        result = evaluate(model, phase.heldout, phase, cfg, dist, most_frequent)
        record = {"step": step, "phase": phase.name, **result}
        evals.append(record)
        if dist.is_main:
            metrics.write("eval", **record)
            progress.write(
                f"step {step}: held-out MLM loss {result['mlm_loss']:.3f} acc {result['mlm_accuracy']:.3f} "
                f"(most-frequent-token {result['mlm_baseline_accuracy']:.3f}), NSP loss {result['nsp_loss']:.3f} "
                f"acc {result['nsp_accuracy']:.3f} (majority {result['nsp_baseline_accuracy']:.3f})")
        return record

    def checkpoint(phase_i: int, stream: BatchStream) -> None:
        rngs = [rng_state(device)]
        if dist.distributed:
            rngs = [None] * dist.world_size
            torch_dist.all_gather_object(rngs, rng_state(device))
        if dist.is_main:
            save_checkpoint(run_dir, step, {
                "format": FORMAT_VERSION, "step": step, "phase": phase_i, "epoch": stream.epoch,
                "batch_in_epoch": stream.batch_in_epoch, "tokens_seen": tokens_seen,
                "wall_time_s": wall_before + time.perf_counter() - start_time,
                "model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "schedule": schedule.state_dict(), "rng": rngs, **checkpoint_meta,
            }, keep=cfg.keep_checkpoints)
        barrier(dist)

    params = [p for p in model.parameters() if p.requires_grad]
    phase_start = 0
    for i, phase in enumerate(phases):
        phase_end = phase_start + phase.steps
        if step >= phase_end:
            phase_start = phase_end
            continue
        if i != phase_idx:  # entering a later phase than the checkpoint's: its data starts afresh
            epoch, batch_in_epoch = 0, 0
        fixed_len = phase.max_seq_len if cfg.compile else None
        data_workers = cfg.data_workers if cfg.data_workers is not None else 4 if device.type == "cuda" else 2
        prepare = functools.partial(cpu_inputs, max_predictions=phase.max_predictions, pad_to=fixed_len,
                                    unpad=cfg.unpad)
        stream = BatchStream(phase.train, phase.batch_size, cfg.seed, dist.rank, dist.world_size, epoch,
                             batch_in_epoch, prepare=prepare, workers=data_workers)
        with stream:  # stops its workers on every way out
            # Running sums over the log window stay on the device: no host sync until a log line.
            window = torch.zeros(3, device=device)  # loss, mlm loss, nsp loss (summed over micro-batches)
            window_tokens, window_start, window_steps, window_wait = 0, time.perf_counter(), 0, 0.0
            while step < phase_end:
                for micro in range(cfg.grad_accum):
                    waiting = time.perf_counter()
                    batch = stream.next()
                    window_wait += time.perf_counter() - waiting
                    window_tokens += batch.tokens
                    inputs = inputs_to_device(batch.inputs, device)
                    sync = (ddp_model.no_sync() if dist.distributed and micro < cfg.grad_accum - 1
                            else contextlib.nullcontext())
                    with sync:
                        with autocast_context(cfg.precision, device):
                            out = step_model(**inputs)
                        (out.loss / cfg.grad_accum).backward()
                    window += torch.stack([out.loss.detach(), out.mlm_loss.detach(), out.nsp_loss.detach()])
                grad_norm = (torch.nn.utils.clip_grad_norm_(params, cfg.clip_norm) if cfg.clip_norm > 0
                             else torch.zeros((), device=device))
                lr = schedule.lr
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                schedule.step()
                step += 1
                window_steps += 1
                progress.update(1)

                if step % cfg.log_every == 0 or step == phase_end:
                    tokens = torch.tensor([window_tokens], dtype=torch.int64, device=device)
                    if dist.distributed:
                        torch_dist.all_reduce(window)
                        torch_dist.all_reduce(tokens)
                        window /= dist.world_size
                    elapsed = time.perf_counter() - window_start
                    tokens_seen += int(tokens)
                    loss, mlm_loss, nsp_loss = (window / (window_steps * cfg.grad_accum)).tolist()
                    tokens_per_s = int(tokens) / max(elapsed, 1e-9)
                    if dist.is_main:
                        metrics.write("train", step=step, phase=phase.name, loss=loss, mlm_loss=mlm_loss,
                                      nsp_loss=nsp_loss, lr=lr, grad_norm=float(grad_norm),
                                      tokens_per_s=tokens_per_s, tokens_seen=tokens_seen, epoch=stream.epoch,
                                      data_wait_s=window_wait,  # this process's, getting the window's batches
                                      elapsed_s=wall_before + time.perf_counter() - start_time)
                        progress.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", lr=f"{lr:.2e}",
                                             refresh=False)
                        if plain_lines:
                            print(f"step {step}/{total_steps}: loss {loss:.3f} (MLM {mlm_loss:.3f}, "
                                  f"NSP {nsp_loss:.3f}), lr {lr:.2e}, {tokens_per_s:,.0f} tokens/s", flush=True)
                    if not math.isfinite(loss):
                        raise FloatingPointError(f"loss is {loss} at step {step}; lower --lr or check the data")
                    window.zero_()
                    window_tokens, window_start, window_steps, window_wait = 0, time.perf_counter(), 0, 0.0

                at_end = step == total_steps
                if cfg.eval_every and step % cfg.eval_every == 0 and not at_end:
                    last_eval = run_eval(phase)
                if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == phase_end:
                    checkpoint(i, stream)
        phase_start = phase_end
    progress.close()
    last_phase = phases[-1]
    if last_eval is None or last_eval["step"] != step:
        last_eval = run_eval(last_phase)
    wall = wall_before + time.perf_counter() - start_time
    if dist.is_main:
        metrics.write("end", step=step, tokens_seen=tokens_seen, wall_time_s=wall)
    return TrainResult(step, tokens_seen, wall, {k: v for k, v in last_eval.items() if k not in ("step", "phase")},
                       evals)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
