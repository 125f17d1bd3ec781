"""The pre-training loop: MLM + NSP steps with AdamW, warm-up/decay, clipping, accumulation, bf16
autocast on GPU, optional torch.compile and DDP; periodic held-out evaluation, metrics (JSONL) and
complete, exactly-resumable checkpoints. Data preparation and the command line live elsewhere
(`training.data`, `training.pretrain`); this module takes prepared datasets and a model."""
from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import json
import math
import os
import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.constants import default_pg_timeout
from tqdm import tqdm

from training.batch_stream import BatchSource, BatchStream
from training.checkpoint import (FORMAT_VERSION, check_world_size, load_checkpoint, rng_state, save_checkpoint,
                                 set_rng_state)
from training.ddp import DDPOptions, compile_ddp, wrap_ddp
from training.model import BertForPreTraining, PreTrainingOutput
from training.model_inputs import cpu_inputs, inputs_to_device, model_inputs
from training.optim import WarmupLinearDecay, make_optimizer
from training.report import write_plots_quietly
from training.stop_signals import stop_requested
from training.writes import write_failed


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
    # Capture the compiled step in CUDA graphs, one per token count (packed batches are filled up to a
    # multiple of CUDA_GRAPH_TOKEN_MULTIPLE tokens): no launch work left on the CPU.
    cuda_graphs: bool = False
    # Processes that build the next training batches during the step (0: in the step). None:
    # default_data_workers().
    data_workers: int | None = None
    ddp: DDPOptions = field(default_factory=DDPOptions)  # how gradients are averaged under torchrun

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
        if self.cuda_graphs and not (self.compile and self.unpad and self.grad_accum == 1):
            raise ValueError("--cuda-graphs needs --compile, padding removed (no --no-unpad) and --grad-accum 1 "
                             "(a replay overwrites the gradients a previous micro-batch left)")
        if self.ddp.static_graph and self.grad_accum > 1:
            raise ValueError("--ddp-static-graph does not go with --grad-accum above 1: DDP's static graph fails "
                             "under no_sync (pytorch/pytorch#143580)")


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


# How long the other ranks wait for what rank 0 alone does first (tokenising a corpus into the cache can take
# hours). A collective of the training's group gives up after that group's timeout (NCCL's 10 minutes, gloo's
# 30), so these waits go through a gloo group of their own, `DistInfo.waits`.
RANK0_WAIT = timedelta(days=7)


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    waits: torch_dist.ProcessGroup | None = field(default=None, compare=False)  # distributed: RANK0_WAIT's group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def setup_distributed(device: str = "auto") -> DistInfo:
    """One process per device. Under `torchrun` (RANK / WORLD_SIZE / LOCAL_RANK set) this joins the
    process group (NCCL on GPUs, gloo on CPUs) and the gloo group of waits for rank 0 (RANK0_WAIT)."""
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
        torch_dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo", **_store_of_this_attempt())
    waits = torch_dist.new_group(backend="gloo", timeout=RANK0_WAIT) if world_size > 1 else None
    return DistInfo(rank, world_size, local_rank, dev, waits)


def stop_agreed(dist: DistInfo) -> bool:
    """Whether any rank was asked to stop (SIGTERM), the same answer on every rank: whether a rank stops
    decides which collective calls it makes next (the checkpoint's), and a signal reaches the ranks at
    different moments, or one alone. A one-integer all-reduce over the gloo group of waits, on the CPU: no
    wait for the GPU."""
    stop = stop_requested()
    if not dist.distributed:
        return stop
    flag = torch.tensor([int(stop)], dtype=torch.int32)
    torch_dist.all_reduce(flag, op=torch_dist.ReduceOp.MAX, group=dist.waits)
    return bool(flag.item())


def _store_of_this_attempt() -> dict[str, Any]:
    """Under torchrun, the process group's rendezvous in the agent's store under keys of this attempt's own.
    torch 2.13 found there the keys a failed attempt had left (the addresses of its processes, gone), so a
    group that `--max-restarts` started again never connected ('Connection refused'). {} elsewhere: env://."""
    env = os.environ
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    agent = torch_dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False,
                                timeout=default_pg_timeout)
    return {"store": torch_dist.PrefixStore(f"attempt-{env['TORCHELASTIC_RESTART_COUNT']}", agent),
            "rank": int(env["RANK"]), "world_size": int(env["WORLD_SIZE"])}


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

    def __init__(self, path: Path | None, step: int = 0):
        """`step`: where the run starts (the checkpoint's). Records of later steps, from an attempt that
        ended before its next checkpoint, are dropped (all of them when starting at 0): the steps they
        describe are about to be trained again."""
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.exists():
                self._keep_until(step)

    def write(self, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        line = json.dumps({"event": event, "time": round(time.time(), 3), **fields}) + "\n"
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            end = os.lseek(fd, 0, os.SEEK_END)
            try:
                os.write(fd, line.encode())  # one write: a line a reader sees is whole
            except OSError as e:
                os.ftruncate(fd, end)  # nor half a line after a failure
                raise write_failed(self.path, e) from e
        finally:
            os.close(fd)

    def _keep_until(self, step: int) -> None:
        kept = []
        if step > 0:
            for line in self.path.read_text(encoding="utf-8").splitlines(keepends=True):
                try:
                    if json.loads(line).get("step", 0) <= step:
                        kept.append(line)
                except json.JSONDecodeError:  # cut off by a kill
                    pass
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        os.replace(tmp, self.path)


@dataclass
class TrainResult:
    steps: int
    tokens_seen: int  # non-padding tokens, all processes
    wall_time_s: float  # this process's training time, summed over resumed runs
    final_eval: dict[str, float]
    evals: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class TrainState:
    """Where a run stands: what a checkpoint records and a resume starts from."""

    step: int = 0  # optimiser steps done
    phase: int = 0  # index of the phase being trained
    epoch: int = 0  # the phase's data position: the next batch is number batch_in_epoch of this epoch
    batch_in_epoch: int = 0
    tokens_seen: int = 0  # non-padding tokens, all processes
    wall_before: float = 0.0  # training time of the runs this one resumes
    clock_start: float = field(default_factory=time.perf_counter)

    @property
    def wall_time_s(self) -> float:
        return self.wall_before + time.perf_counter() - self.clock_start

    def record(self) -> dict[str, Any]:
        return {"step": self.step, "phase": self.phase, "epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch,
                "tokens_seen": self.tokens_seen, "wall_time_s": self.wall_time_s}

    @classmethod
    def from_checkpoint(cls, state: dict[str, Any]) -> TrainState:
        return cls(state["step"], state["phase"], state["epoch"], state["batch_in_epoch"], state["tokens_seen"],
                   state["wall_time_s"])


@dataclass
class Learner:
    """The model in the wrappings a step needs, and what updates it."""

    model: BertForPreTraining  # bare: state dicts and evaluation
    ddp_model: nn.Module  # DistributedDataParallel around it (no_sync while accumulating), or itself
    step_model: nn.Module  # what a training step calls: ddp_model, compiled if asked
    optimizer: torch.optim.Optimizer
    schedule: WarmupLinearDecay
    params: list[nn.Parameter]  # those clipped, in model order


@dataclass
class WindowTotals:
    """A log window over all processes: tokens summed, losses averaged over micro-batches and processes."""

    loss: float
    mlm_loss: float
    nsp_loss: float
    tokens: int
    elapsed_s: float
    data_wait_s: float  # this process's, getting the window's batches


class LogWindow:
    """The steps since the last log line. Loss sums stay on the device, so that only the log line waits
    for the device (one host sync per line, not per step)."""

    def __init__(self, device: torch.device):
        self.losses = torch.zeros(3, device=device)  # loss, MLM loss, NSP loss, summed over micro-batches
        self._reset()

    def _reset(self) -> None:
        self.losses.zero_()
        self.tokens, self.micro_batches, self.data_wait_s, self.started = 0, 0, 0.0, time.perf_counter()

    def add(self, out: PreTrainingOutput, tokens: int, data_wait_s: float) -> None:
        self.losses += torch.stack([out.loss.detach(), out.mlm_loss.detach(), out.nsp_loss.detach()])
        self.tokens += tokens
        self.micro_batches += 1
        self.data_wait_s += data_wait_s

    def close(self, dist: DistInfo) -> WindowTotals:
        """The window's totals over all processes; the next window starts now."""
        tokens = torch.tensor([self.tokens], dtype=torch.int64, device=self.losses.device)
        if dist.distributed:
            torch_dist.all_reduce(self.losses)
            torch_dist.all_reduce(tokens)
            self.losses /= dist.world_size
        elapsed = time.perf_counter() - self.started
        loss, mlm_loss, nsp_loss = (self.losses / self.micro_batches).tolist()
        totals = WindowTotals(loss, mlm_loss, nsp_loss, int(tokens), elapsed, self.data_wait_s)
        self._reset()
        return totals


class RunLog:
    """Everything a run reports, in one place: metrics.jsonl and the progress bar on a terminal (or
    plain lines elsewhere), from the main process."""

    def __init__(self, run_dir: Path, dist: DistInfo, total_steps: int, step: int, show_progress: bool):
        self.is_main, self.total_steps, self.run_dir = dist.is_main, total_steps, Path(run_dir)
        self.metrics = MetricsLog(self.run_dir / "metrics.jsonl" if dist.is_main else None, step)
        # disable=None: a bar on a terminal only; elsewhere (a log file) plain lines at each log step.
        self.progress = tqdm(total=total_steps, initial=step, disable=None if show_progress and dist.is_main else True,
                             unit="step", dynamic_ncols=True, desc="pretrain")
        self.plain_lines = dist.is_main and self.progress.disable  # --no-progress, or not a terminal

    def start(self, **fields: Any) -> None:
        self.metrics.write("start", **fields)

    def train(self, state: TrainState, phase: Phase, window: WindowTotals, lr: float, grad_norm: torch.Tensor) -> None:
        """The log line of a window; a FloatingPointError (on every process) if its loss is not finite."""
        tokens_per_s = window.tokens / max(window.elapsed_s, 1e-9)
        if self.is_main:
            self.metrics.write("train", step=state.step, phase=phase.name, loss=window.loss, mlm_loss=window.mlm_loss,
                               nsp_loss=window.nsp_loss, lr=lr, grad_norm=float(grad_norm),
                               tokens_per_s=tokens_per_s, tokens_seen=state.tokens_seen, epoch=state.epoch,
                               data_wait_s=window.data_wait_s, elapsed_s=state.wall_time_s)
            self.progress.set_postfix(loss=f"{window.loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", lr=f"{lr:.2e}",
                                      refresh=False)
            if self.plain_lines:
                print(f"step {state.step}/{self.total_steps}: loss {window.loss:.3f} (MLM {window.mlm_loss:.3f}, "
                      f"NSP {window.nsp_loss:.3f}), lr {lr:.2e}, {tokens_per_s:,.0f} tokens/s", flush=True)
        if not math.isfinite(window.loss):
            raise FloatingPointError(f"loss is {window.loss} at step {state.step}; lower --lr or check the data")

    def eval(self, step: int, phase: Phase, result: dict[str, float]) -> dict[str, Any]:
        """The held-out result as a record of the run (returned) and a log line."""
        record = {"step": step, "phase": phase.name, **result}
        if self.is_main:
            self.metrics.write("eval", **record)
            self.progress.write(
                f"step {step}: held-out MLM loss {result['mlm_loss']:.3f} acc {result['mlm_accuracy']:.3f} "
                f"(most-frequent-token {result['mlm_baseline_accuracy']:.3f}), NSP loss {result['nsp_loss']:.3f} "
                f"acc {result['nsp_accuracy']:.3f} (majority {result['nsp_baseline_accuracy']:.3f})")
            write_plots_quietly(self.run_dir)  # training.png beside metrics.jsonl (training/report.py)
        return record

    def phase_start(self, step: int, number: int, phase: Phase, cfg: TrainConfig, world_size: int) -> None:
        """The line that marks a later phase's first step."""
        if self.is_main:
            self.progress.write(f"step {step}: phase {number} begins, {phase_schedule(phase, cfg, world_size)}")

    def end(self, state: TrainState, wall_time_s: float) -> None:
        self.metrics.write("end", step=state.step, tokens_seen=state.tokens_seen, wall_time_s=wall_time_s)


# Packed batches under --cuda-graphs are filled up to a multiple of this many tokens: a batch of 256 at
# length 128 then takes about 25 distinct token counts (one graph each) for 0.6% filler tokens.
CUDA_GRAPH_TOKEN_MULTIPLE = 256


def check_config(cfg: TrainConfig, dist: DistInfo) -> None:
    """What the configuration needs of the hardware, before anything is spent."""
    if cfg.cuda_graphs and dist.device.type != "cuda":
        raise ValueError("--cuda-graphs needs a CUDA device")


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
    check_config(cfg, dist)
    torch.backends.cuda.matmul.allow_tf32 = True  # only matters for fp32 on GPU
    torch.backends.cudnn.allow_tf32 = True
    model.to(dist.device).train()
    total_steps = sum(p.steps for p in phases)
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, dist.device)
    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else round(cfg.warmup_fraction * total_steps)
    schedule = WarmupLinearDecay(optimizer, cfg.lr, min(warmup, total_steps), total_steps)
    if resume_from is not None:
        checkpoint = resume_state if resume_state is not None else load_checkpoint(resume_from)
        state = _restore(checkpoint, resume_from, model, optimizer, schedule, dist)
    else:
        state = TrainState()
        _seed_everything(cfg.seed + dist.rank)  # same weights on every rank come from the seed; dropout differs
    learner = build_learner(model, optimizer, schedule, cfg, dist)
    log = RunLog(run_dir, dist, total_steps, state.step, show_progress)
    log.start(step=state.step, total_steps=total_steps, world_size=dist.world_size, device=str(dist.device),
              resumed_from=str(resume_from) if resume_from else None,
              effective_batch=phases[min(state.phase, len(phases) - 1)].batch_size * cfg.grad_accum * dist.world_size)
    state.clock_start = time.perf_counter()
    most_frequent = phases[0].train.most_frequent_token_id()
    evals: list[dict[str, Any]] = []

    with _collecting_between_steps():
        for i, (phase, phase_end) in enumerate(zip(phases, itertools.accumulate(p.steps for p in phases))):
            if state.step >= phase_end:
                continue
            if i != state.phase:  # entering a later phase than the checkpoint's: its data starts afresh
                state.phase, state.epoch, state.batch_in_epoch = i, 0, 0
                log.phase_start(state.step, i + 1, phase, cfg, dist.world_size)
            with batch_stream(phase, state, cfg, dist) as stream:  # stops its workers on every way out
                window = LogWindow(dist.device)
                while state.step < phase_end:
                    lr, grad_norm = optimizer_step(learner, stream, window, cfg, dist)
                    state.step += 1
                    # the position after the batches taken
                    state.epoch, state.batch_in_epoch = stream.epoch, stream.batch_in_epoch
                    log.progress.update(1)
                    stopping = stop_agreed(dist)  # read once: a signal later in this step is taken at the next
                    checkpoint_due = bool((cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0)
                                          or state.step == phase_end or stopping)
                    # a checkpoint closes the window too: a resume starts a new one, and the tokens of the
                    # steps since the last log line would otherwise never reach tokens_seen
                    if state.step % cfg.log_every == 0 or checkpoint_due:
                        totals = window.close(dist)
                        state.tokens_seen += totals.tokens
                        log.train(state, phase, totals, lr, grad_norm)
                    if cfg.eval_every and state.step % cfg.eval_every == 0 and state.step != total_steps:
                        evals.append(log.eval(state.step, phase, evaluate(model, phase.heldout, phase, cfg, dist,
                                                                          most_frequent)))
                    if checkpoint_due:
                        _checkpoint(learner, state, run_dir, dist, checkpoint_meta, cfg.keep_checkpoints)
                    if stopping:  # SIGTERM (or a lost Ctrl-C): ends as Ctrl-C does, with this step's checkpoint
                        raise KeyboardInterrupt
                    if state.step % GC_EVERY_STEPS == 0:
                        gc.collect(1)
    log.progress.close()
    if not evals or evals[-1]["step"] != state.step:
        evals.append(log.eval(state.step, phases[-1], evaluate(model, phases[-1].heldout, phases[-1], cfg, dist,
                                                               most_frequent)))
    wall = state.wall_time_s
    log.end(state, wall)
    final = {k: v for k, v in evals[-1].items() if k not in ("step", "phase")}
    return TrainResult(state.step, state.tokens_seen, wall, final, evals)


def phase_schedule(phase: Phase, cfg: TrainConfig, world_size: int) -> str:
    """A phase's length in words: its steps, and the sequences (over every process) and tokens of each."""
    return (f"{phase.steps} steps of {phase.batch_size * cfg.grad_accum * world_size} sequences of "
            f"{phase.max_seq_len} tokens")


# Python's automatic collection, left on, starts at random points of a step and stalls the thread that
# launches the GPU's work, which only just keeps ahead of the device (BENCHMARKS.md). Large trainers turn
# it off while training and collect the young generations on a schedule instead.
GC_EVERY_STEPS = 100


@contextlib.contextmanager
def _collecting_between_steps() -> Iterator[None]:
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _restore(checkpoint: dict[str, Any], path: Path, model: BertForPreTraining, optimizer: torch.optim.Optimizer,
             schedule: WarmupLinearDecay, dist: DistInfo) -> TrainState:
    """Weights, optimiser, schedule and this process's random state from `checkpoint` (read from `path`)."""
    model.load_state_dict(checkpoint["model"])
    # the run's own weight decay, not the checkpoint's (which load_state_dict would put back): --resume takes a
    # changed --weight-decay as it takes a changed --lr (the schedule sets the learning rate)
    weight_decay = [group["weight_decay"] for group in optimizer.param_groups]
    optimizer.load_state_dict(checkpoint["optimizer"])
    for group, decay in zip(optimizer.param_groups, weight_decay):
        group["weight_decay"] = decay
    schedule.load_state_dict(checkpoint["schedule"])
    check_world_size(path, checkpoint, dist.world_size)
    set_rng_state(checkpoint["rng"][dist.rank], dist.device)
    return TrainState.from_checkpoint(checkpoint)


def build_learner(model: BertForPreTraining, optimizer: torch.optim.Optimizer, schedule: WarmupLinearDecay,
                  cfg: TrainConfig, dist: DistInfo) -> Learner:
    """Wrapped for DDP when distributed (after a restore: DDP starts every rank from rank 0's weights) and
    compiled when asked. Public, with optimizer_step, so that bench/ddp_scaling.py times the trainer's step."""
    ddp_model: nn.Module = wrap_ddp(model, dist.device, cfg.ddp) if dist.distributed else model
    if not cfg.compile:
        step_model = ddp_model
    else:
        mode = "reduce-overhead" if cfg.cuda_graphs else None  # reduce-overhead: Inductor's CUDA graphs
        if cfg.cuda_graphs:  # one graph per token count is the plan (about 25), not a problem to warn of
            import torch._inductor.config as inductor_config
            inductor_config.triton.cudagraph_dynamic_shape_warn_limit = None
        step_model = compile_ddp(ddp_model, cfg.ddp, mode) if dist.distributed else torch.compile(model, mode=mode)
    params = [p for p in model.parameters() if p.requires_grad]
    return Learner(model, ddp_model, step_model, optimizer, schedule, params)


def batch_stream(phase: Phase, state: TrainState, cfg: TrainConfig, dist: DistInfo) -> BatchStream:
    """The phase's training batches from the state's data position, as CPU model inputs. Compiled, every
    batch is padded to the phase's length, so that the model sees one shape. Public, with optimizer_step,
    so that bench/time_to_quality.py times the trainer's own data path."""
    fixed_len = phase.max_seq_len if cfg.compile else None
    workers = cfg.data_workers if cfg.data_workers is not None else default_data_workers(dist)
    prepare = functools.partial(cpu_inputs, max_predictions=phase.max_predictions, pad_to=fixed_len, unpad=cfg.unpad,
                                token_multiple=CUDA_GRAPH_TOKEN_MULTIPLE if cfg.cuda_graphs else None)
    return BatchStream(phase.train, phase.batch_size, cfg.seed, dist.rank, dist.world_size, state.epoch,
                       state.batch_in_epoch, prepare=prepare, workers=workers,
                       pin_memory=dist.device.type == "cuda")


def default_data_workers(dist: DistInfo) -> int:
    """On a GPU, half this process's share of the host's cores, 2 to 8: on a 16-core H100 host a BERT-base
    step at batch 256 outpaces 4 workers (3 ms a step waiting for data) but not 8 (BENCHMARKS.md). On a
    CPU the workers take cores from the step itself: 2."""
    if dist.device.type != "cuda":
        return 2
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return max(2, min(8, (os.cpu_count() or 4) // local_processes // 2))


def optimizer_step(learner: Learner, stream: BatchStream, window: LogWindow, cfg: TrainConfig,
                   dist: DistInfo) -> tuple[float, torch.Tensor]:
    """`cfg.grad_accum` micro-batches (DDP averages gradients over processes on the last one only), clipping
    and one optimiser step -> (the step's learning rate, the gradient norm before clipping, on the device)."""
    for micro in range(cfg.grad_accum):
        waiting = time.perf_counter()
        batch = stream.next()
        data_wait = time.perf_counter() - waiting
        inputs = inputs_to_device(batch.inputs, dist.device)
        accumulating = dist.distributed and micro < cfg.grad_accum - 1
        with learner.ddp_model.no_sync() if accumulating else contextlib.nullcontext():
            if cfg.cuda_graphs:  # the previous step's graph outputs (loss, gradients) are used up
                torch.compiler.cudagraph_mark_step_begin()
            with autocast_context(cfg.precision, dist.device):
                out = learner.step_model(**inputs)
            (out.loss / cfg.grad_accum).backward()
        window.add(out, batch.tokens, data_wait)
    grad_norm = (torch.nn.utils.clip_grad_norm_(learner.params, cfg.clip_norm) if cfg.clip_norm > 0
                 else torch.zeros((), device=dist.device))
    lr = learner.schedule.lr
    learner.optimizer.step()
    learner.optimizer.zero_grad(set_to_none=True)
    learner.schedule.step()
    return lr, grad_norm


def _checkpoint(learner: Learner, state: TrainState, run_dir: Path, dist: DistInfo, meta: dict[str, Any],
                keep: int) -> None:
    """Every process's random state, gathered; the main process writes the checkpoint; all wait for it."""
    rngs = [rng_state(dist.device)]
    if dist.distributed:
        rngs = [None] * dist.world_size
        torch_dist.all_gather_object(rngs, rng_state(dist.device))
    if dist.is_main:
        save_checkpoint(run_dir, state.step, {
            "format": FORMAT_VERSION, **state.record(),
            "model": learner.model.state_dict(), "optimizer": learner.optimizer.state_dict(),
            "schedule": learner.schedule.state_dict(), "rng": rngs, **meta,
        }, keep=keep)
    barrier(dist)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
