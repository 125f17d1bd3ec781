"""DDP scaling of a full pre-training step: tokens/s of 1 process against N (one per GPU) at the same
per-process batch, for several ways of wrapping the model in DDP (training.ddp). Each step is the trainer's
own (training.trainer.build_learner and optimizer_step): forward under bf16 autocast, backward with the
gradient all-reduce, clipping, fused AdamW, on BertForPreTraining compiled as the trainer compiles it.

    python bench/ddp_scaling.py                     # on a 2-GPU machine: N=1 and N=2, batches 256 and 128
    python bench/ddp_scaling.py --variants plain,bf16+asview --batch-sizes 128 --steps 40
    python bench/ddp_scaling.py --batches B.npz     # real batches (bench/train_throughput.py --save-batches)
    python bench/ddp_scaling.py --batch-sizes 128 --variants trainer --profile-steps 4 --trace-dir $OUT/traces
                                                    # where each rank's step goes, and a trace per rank
    python bench/ddp_scaling.py --device cpu --preset tiny --vocab-size 1000 --seq-len 32 --max-predictions 5 \\
        --batch-sizes 8 --steps 3 --warmup 1        # smoke test on CPU (gloo)

Run it as a plain script: it starts itself under torchrun (`python -m torch.distributed.run --standalone`)
once per process count of --nprocs, in turn, and each of those runs measures every variant and batch size in
one process group. With one process there is no DDP: that run times the single-device step once per batch
size, and scaling is N processes' total tokens/s over it. Batch sizes are per process. Compilation and
warm-up are excluded from the timing (the first step's time, compilation included, is printed). Inputs are
synthetic full-length batches (different on every rank and step, from a small pool) unless --batches gives
real ones. A variant joins options with '+' onto DDP with torch's defaults:

    plain     torch's defaults: DDP as the trainer wrapped it before training.ddp
    trainer   training.ddp.DDPOptions() as they are: what `python -m training.pretrain` runs by default
    asview    gradient_as_bucket_view=True                (the trainer's default; --no-ddp-bucket-view)
    bf16      gradients averaged in bf16 by training.ddp's hook (--ddp-bf16-grads)
    bucketN   bucket_cap_mb=N                             (--ddp-bucket-mb N)
    nobcast   broadcast_buffers=False                     (the trainer's default: its one buffer is constant)
    onegraph  compiled as one graph, not one per bucket   (the trainer's default; --ddp-graph-per-bucket: off)
    static    static_graph=True                           (--ddp-static-graph; refused with --grad-accum above 1)
    torchbf16 torch's bf16_compress_hook instead of training.ddp's: the same arithmetic (torch built with CUDA only)
    nocomm    diagnostic, wrong gradients: a comm hook that all-reduces nothing (the step without communication)
    avg       a comm hook averaging in the all-reduce (ReduceOp.AVG, NCCL only) instead of dividing first
    graphs    the compiled step replayed from CUDA graphs (the trainer's --cuda-graphs); the one-process run
              then also times single+graphs
    stop      each step followed by the training loop's agreement on stopping (training.trainer.stop_agreed:
              a one-integer all-reduce over the gloo group), as `python -m training.pretrain` runs it

The whole run stops starting measurements when --budget-s would be exceeded (the rest are listed as skipped).
Prints `nvidia-smi topo -m` (NVLink or PCIe between the GPUs), all-reduces of the model's gradient size (fp32,
bf16, and fp32 in DDP's 25 MB buckets), and a table; writes JSON to $OUT/ddp_scaling.json when OUT is set (or to --json), after each
process count, so a run cut short keeps what it measured.
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from bench.train_throughput import load_batches, make_batch  # noqa: E402
from training.batch_stream import StreamBatch  # noqa: E402
from training.ddp import DDPOptions  # noqa: E402
from training.model import BertForPreTraining, preset_config  # noqa: E402
from training.model_inputs import cpu_inputs  # noqa: E402
from training.optim import WarmupLinearDecay, make_optimizer  # noqa: E402
from training.trainer import (CUDA_GRAPH_TOKEN_MULTIPLE, DistInfo, LogWindow, TrainConfig,  # noqa: E402
                              build_learner, optimizer_step, setup_distributed, stop_agreed,
                              teardown_distributed)

# In order of what they tell: torch's defaults, gradients as bucket views, the trainer's defaults (one compiled
# graph, no buffer broadcast), bf16 on top, and the step with no communication at all (the most any all-reduce
# setting could give).
DEFAULT_VARIANTS = "plain,asview,trainer,trainer+bf16,trainer+nocomm"
SINGLE = "single"  # the one-process run's only variant: no DDP


@dataclass(frozen=True)
class Variant:
    name: str
    options: DDPOptions
    hook: Callable | None = None  # a communication hook registered after training.ddp's wrapping
    cuda_graphs: bool = False
    stop_agreement: bool = False


def parse_variant(name: str) -> Variant:
    options, hooks = DDPOptions(bucket_view=False, broadcast_buffers=True, graph_per_bucket=True), []  # torch's
    graphs = stop = False
    for part in name.split("+"):
        if part == "plain":
            pass
        elif part == "trainer":
            options = DDPOptions()
        elif part == "asview":
            options = replace(options, bucket_view=True)
        elif part == "bf16":
            options = replace(options, bf16_grads=True)
        elif part == "nobcast":
            options = replace(options, broadcast_buffers=False)
        elif part == "onegraph":
            options = replace(options, graph_per_bucket=False)
        elif part == "static":
            options = replace(options, static_graph=True)
        elif part.startswith("bucket") and part[6:].replace(".", "", 1).isdigit():
            options = replace(options, bucket_mb=float(part[6:]))
        elif part == "torchbf16":
            hooks.append(default_hooks.bf16_compress_hook)
        elif part == "nocomm":
            hooks.append(_no_comm)
        elif part == "avg":
            hooks.append(_average_all_reduce)
        elif part == "graphs":
            graphs = True
        elif part == "stop":
            stop = True
        else:
            raise ValueError(f"unknown variant part {part!r} in {name!r}; use plain, trainer, asview, bf16, "
                             "bucketN, nobcast, onegraph, static, torchbf16, nocomm, avg, graphs, stop")
    if len(hooks) + options.bf16_grads > 1:
        raise ValueError(f"{name!r} asks for two communication hooks (bf16, torchbf16, nocomm, avg); DDP takes one")
    return Variant(name, options, hooks[0] if hooks else None, graphs, stop)


def _no_comm(state, bucket):  # no annotations: DDP checks them against the classes, and ours are strings
    """Each rank keeps its own gradients: what a step costs when nothing crosses between devices."""
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def _average_all_reduce(group, bucket):  # no annotations, as _no_comm
    """The bucket averaged by the all-reduce itself (NCCL's ncclAvg), instead of DDP's division first."""
    return torch_dist.all_reduce(bucket.buffer(), op=torch_dist.ReduceOp.AVG, group=group,
                                 async_op=True).get_future().then(lambda done: done.value()[0])


class PreparedBatches:
    """The trainer's BatchStream reduced to what optimizer_step reads: prepared batches in turn."""

    def __init__(self, batches: list[StreamBatch]):
        self._turns = itertools.cycle(batches)

    def next(self) -> StreamBatch:
        return next(self._turns)


def input_pool(args: argparse.Namespace, batch_size: int, compiled: bool, dist: DistInfo,
               cuda_graphs: bool = False) -> list[StreamBatch]:
    """This rank's batches, prepared as the trainer's data workers prepare them (CPU model inputs)."""
    if args.batches:
        arrays = load_batches(args.batches)
        rows = {k: torch.cat([b[k] for b in arrays]) for k in arrays[0]}
        if rows["input_ids"].shape[1] > args.seq_len:
            raise ValueError(f"{args.batches} holds rows of {rows['input_ids'].shape[1]} tokens; pass --seq-len "
                             f"{rows['input_ids'].shape[1]} or more")
        count = min(args.pool, len(rows["input_ids"]) // (batch_size * dist.world_size))
        if count == 0:
            raise ValueError(f"{args.batches} holds {len(rows['input_ids'])} sequences, fewer than one batch of "
                             f"{batch_size} x {dist.world_size} processes")
        starts = [(i * dist.world_size + dist.rank) * batch_size for i in range(count)]
        batches = [{k: v[s:s + batch_size] for k, v in rows.items()} for s in starts]
    else:
        masked = min(args.max_predictions, round(0.15 * args.seq_len))
        batches = [make_batch(batch_size, args.seq_len, args.vocab_size, masked, seed=1000 * dist.rank + i)
                   for i in range(args.pool)]
    # Compiled, the trainer pads every batch to the phase's length, so that the model sees one shape.
    multiple = CUDA_GRAPH_TOKEN_MULTIPLE if cuda_graphs else None
    return [StreamBatch(0, i, int(b["attention_mask"].sum()),
                        cpu_inputs(b, args.max_predictions, pad_to=args.seq_len if compiled else None,
                                   unpad=args.unpad, token_multiple=multiple))
            for i, b in enumerate(batches)]


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(learner, source, window: LogWindow, cfg: TrainConfig, dist: DistInfo, steps: int,
                stop_agreement: bool = False) -> float:
    """Seconds for `steps` optimiser steps of the trainer's own, the device's queue drained at the end."""
    started = time.perf_counter()
    for _ in range(steps):
        optimizer_step(learner, source, window, cfg, dist)
        if stop_agreement:
            stop_agreed(dist)
    sync_device(dist.device)
    return time.perf_counter() - started


def _gathered(value: Any, dist: DistInfo) -> list[Any]:
    """`value` of every rank, in rank order (anything picklable: a figure, a rank's profile)."""
    if not dist.distributed:
        return [value]
    out: list[Any] = [None] * dist.world_size
    torch_dist.all_gather_object(out, value)
    return out


def measure(args: argparse.Namespace, variant: Variant, batch_size: int, pool: list[StreamBatch], compiled: bool,
            dist: DistInfo) -> dict[str, Any]:
    """Warm-up, then `args.steps` timed optimiser steps of a fresh model (the same initial weights and
    dropout seeds for every variant, so that their losses compare)."""
    torch.manual_seed(args.seed)
    model = BertForPreTraining(preset_config(args.preset, vocab_size=args.vocab_size)).to(dist.device).train()
    cfg = TrainConfig(batch_size=batch_size, grad_accum=args.grad_accum, lr=args.lr, precision=args.precision,
                      compile=compiled, ddp=variant.options, cuda_graphs=variant.cuda_graphs)
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, dist.device)
    schedule = WarmupLinearDecay(optimizer, cfg.lr, args.warmup, args.warmup + args.steps)
    torch.manual_seed(args.seed + dist.rank)  # as the trainer: dropout differs by rank
    learner = build_learner(model, optimizer, schedule, cfg, dist)
    if variant.hook is not None:
        learner.ddp_model.register_comm_hook(None, variant.hook)
    stream, window = PreparedBatches(pool), LogWindow(dist.device)

    stop = variant.stop_agreement
    first_step_s = timed_steps(learner, stream, window, cfg, dist, 1, stop)
    warmup_s = first_step_s + timed_steps(learner, stream, window, cfg, dist, args.warmup - 1, stop)
    window.close(dist)  # the timed window starts empty
    if dist.distributed:
        torch_dist.barrier()
    if dist.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dist.device)

    elapsed = timed_steps(learner, stream, window, cfg, dist, args.steps, stop)
    profiled = None
    if args.profile_steps:
        trace = Path(args.trace_dir) / f"{variant.name}-b{batch_size}" if args.trace_dir else None
        profiled = _gathered(profile_steps(learner, stream, window, cfg, dist, args.profile_steps, trace), dist)
    tokens = window.tokens  # this process's, before close() sums them over processes
    totals = window.close(dist)  # losses averaged over the timed micro-batches and processes
    elapsed_all = _gathered(elapsed, dist)
    per_process = _gathered(tokens / elapsed, dist)
    result = {
        "ms_per_step": max(elapsed_all) / args.steps * 1e3,  # the slowest process sets the pace
        "tokens_per_s_total": totals.tokens / max(elapsed_all),
        "tokens_per_s_per_process": per_process,
        "tokens_per_step_total": totals.tokens / args.steps,
        "first_step_s": first_step_s,  # compilation included
        "warmup_s": warmup_s,
        "loss": totals.loss, "mlm_loss": totals.mlm_loss, "nsp_loss": totals.nsp_loss,
        "peak_memory_gib": torch.cuda.max_memory_allocated(dist.device) / 2**30 if dist.device.type == "cuda" else None,
        **({"profile": profiled} if profiled else {}),
    }
    del learner, model, optimizer, schedule
    return result


def _busy_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals in µs, as ms."""
    busy, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            busy += end - max(start, reach)
            reach = end
    return busy / 1e3


def profile_steps(learner, stream, window, cfg: TrainConfig, dist: DistInfo, steps: int,
                  trace: Path | None = None) -> dict[str, Any]:
    """`steps` more steps under torch.profiler (every rank: the collectives need them all), this rank's
    view: per step, the wall time, how long the GPU ran anything (compute and NCCL kernels) and compute
    alone, how far the CPU had run ahead of the GPU when the last step was launched (near 0: launching is
    the limit), the CPU operators that took the most of this process's own time and the GPU kernels that
    took the most GPU time. A GPU busy for much less than the wall time waits for the CPU or for another
    rank; NCCL time well above an all-reduce's own is waiting for another rank. `trace`: also a gzipped
    Chrome trace there."""
    import gzip
    import shutil

    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dist.device.type == "cuda" else [])
    sync_device(dist.device)
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(steps):
            optimizer_step(learner, stream, window, cfg, dist)
        launched = time.perf_counter()
        sync_device(dist.device)
        done = time.perf_counter()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    compute = [(e.time_range.start, e.time_range.end) for e in kernels if "nccl" not in e.name.lower()]
    averages = prof.key_averages()
    top = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)[:12]
    top_gpu = sorted(averages, key=lambda a: a.self_device_time_total, reverse=True)[:25]
    if trace is not None:
        trace.mkdir(parents=True, exist_ok=True)
        plain = trace / f"rank{dist.rank}.json"
        prof.export_chrome_trace(str(plain))
        with plain.open("rb") as f, gzip.open(f"{plain}.gz", "wb") as g:
            shutil.copyfileobj(f, g)
        plain.unlink()
    busy, busy_compute = _busy_ms(spans) / steps, _busy_ms(compute) / steps
    return {"rank": dist.rank, "steps": steps, "wall_ms_per_step": (done - started) * 1e3 / steps,
            "gpu_busy_ms_per_step": busy, "gpu_compute_ms_per_step": busy_compute,
            "gpu_nccl_only_ms_per_step": busy - busy_compute,
            "cpu_ahead_at_end_ms": (done - launched) * 1e3,
            "cuda_kernels_per_step": len(kernels) / steps,
            "top_self_cpu_ms_per_step": {a.key[:80]: round(a.self_cpu_time_total / 1e3 / steps, 3) for a in top},
            "top_gpu_ms_per_step": {a.key[:80]: round(a.self_device_time_total / 1e3 / steps, 3) for a in top_gpu
                                    if a.self_device_time_total > 0}}


def allreduce_timings(numel: int, dist: DistInfo, repeats: int = 5) -> list[dict[str, Any]]:
    """All-reduces of the whole gradient (every parameter once): in one piece in fp32 and in bf16, and in
    fp32 as DDP sends it, in pieces of its default bucket size (25 MB) one after another. Bus bandwidth as
    NCCL's tests report it: bytes x 2(N-1)/N over time. NCCL picks its protocol by message size, so the
    pieces can run slower than the whole."""
    rows = []
    for dtype, piece_mb in ((torch.float32, None), (torch.bfloat16, None), (torch.float32, 25)):
        t = torch.ones(numel, dtype=dtype, device=dist.device)
        pieces = [t] if piece_mb is None else list(t.split(int(piece_mb * 2**20) // t.element_size()))

        def all_reduce() -> None:
            for work in [torch_dist.all_reduce(p, async_op=True) for p in pieces]:
                work.wait()

        for _ in range(2):
            all_reduce()
        sync_device(dist.device)
        torch_dist.barrier()
        started = time.perf_counter()
        for _ in range(repeats):
            all_reduce()
        sync_device(dist.device)
        seconds = max(_gathered((time.perf_counter() - started) / repeats, dist))
        size = numel * t.element_size()
        rows.append({"dtype": str(dtype).removeprefix("torch."), "mb": size / 1e6, "pieces": len(pieces),
                     "ms": seconds * 1e3,
                     "bus_gb_per_s": size * 2 * (dist.world_size - 1) / dist.world_size / seconds / 1e9})
        del t, pieces
    return rows


def _out_of_time(deadline: float, longest_s: float, dist: DistInfo) -> bool:
    """Rank 0 decides whether the next measurement still fits, and every rank follows it (a rank that
    stopped alone would leave the others waiting in a collective)."""
    late = torch.tensor([float(time.time() + 1.1 * longest_s > deadline)], device=dist.device)
    if dist.distributed:
        torch_dist.broadcast(late, src=0)
    return bool(late.item())


def worker(args: argparse.Namespace) -> int:
    """One process of a torchrun: every measurement of this process count, in one process group; rank 0
    appends one JSON line per result to --results."""
    dist = setup_distributed(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    compiled = args.compile == "on" or (args.compile == "auto" and dist.device.type == "cuda")
    results = Path(args.results)

    def record(**fields: Any) -> None:
        if dist.is_main:
            with results.open("a") as f:
                f.write(json.dumps({"nproc": dist.world_size, **fields}) + "\n")

    try:
        with torch.device("meta"):  # only the parameter count: no memory, no initialisation time
            numel = sum(p.numel() for p in BertForPreTraining(preset_config(args.preset, args.vocab_size)).parameters())
        record(kind="environment", torch=torch.__version__, compile=compiled, parameters=numel,
               card=torch.cuda.get_device_name(dist.device) if dist.device.type == "cuda" else "cpu",
               nccl=".".join(map(str, torch.cuda.nccl.version())) if dist.device.type == "cuda" else None)
        if dist.distributed:
            for row in allreduce_timings(numel, dist):
                record(kind="allreduce", **row)
                if dist.is_main:
                    print(f"all-reduce of {row['mb']:.0f} MB in {row['dtype']}, {row['pieces']} piece(s), over "
                          f"{dist.world_size} processes: "
                          f"{row['ms']:.2f} ms ({row['bus_gb_per_s']:.1f} GB/s bus bandwidth)", flush=True)
        asked = [parse_variant(v) for v in args.variants.split(",")]
        variants = asked if dist.distributed else [Variant(SINGLE, DDPOptions())] + (
            [Variant(SINGLE + "+graphs", DDPOptions(), cuda_graphs=True)] if any(v.cuda_graphs for v in asked) else [])
        pools: dict[tuple[int, bool], list[StreamBatch]] = {}
        longest = 0.0
        for variant, batch_size in itertools.product(variants, args.batch_sizes):  # each variant at every batch first
            fields = {"kind": "run", "variant": variant.name, "batch_size": batch_size,
                      "options": asdict(variant.options) if dist.distributed else None}
            if _out_of_time(args.deadline, longest, dist):
                record(**fields, skipped="--budget-s reached")
                if dist.is_main:
                    print(f"N={dist.world_size} batch {batch_size} {variant.name}: skipped (--budget-s)", flush=True)
                continue
            started = time.perf_counter()
            try:
                key = batch_size, variant.cuda_graphs
                if key not in pools:
                    pools[key] = input_pool(args, batch_size, compiled, dist, variant.cuda_graphs)
                result = measure(args, variant, batch_size, pools[key], compiled, dist)
                record(**fields, **result)
                if dist.is_main and "profile" in result:
                    for rank in result["profile"]:
                        print(json.dumps({"variant": variant.name, "batch_size": batch_size, **rank}, indent=1),
                              flush=True)
                if dist.is_main:
                    print(f"N={dist.world_size} batch {batch_size} {variant.name}: {result['ms_per_step']:.1f} ms/step, "
                          f"{result['tokens_per_s_total']:,.0f} tokens/s, loss {result['loss']:.4f} (first step "
                          f"{result['first_step_s']:.1f} s)", flush=True)
            except Exception as e:  # a variant this torch cannot run; the others still can
                record(**fields, error=f"{type(e).__name__}: {e}")
                print(f"N={dist.world_size} batch {batch_size} {variant.name} failed on rank {dist.rank}: "
                      f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
            finally:
                gc.collect()
                torch._dynamo.reset()  # each variant compiles afresh (on-disk caches still help)
                if dist.device.type == "cuda":
                    torch.cuda.empty_cache()
            longest = max(longest, time.perf_counter() - started)
    finally:
        teardown_distributed()
    return 0


def topology() -> str | None:
    """`nvidia-smi topo -m`: NV# between the GPUs is NVLink; PIX / PXB / PHB / NODE / SYS are PCIe paths."""
    try:
        done = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        return f"nvidia-smi topo -m unavailable: {e}"
    return done.stdout if done.returncode == 0 else f"nvidia-smi topo -m failed: {done.stderr.strip()[:500]}"


def run_torchrun(nproc: int, argv: list[str], results: Path, deadline: float) -> str:
    """This script under torchrun with `nproc` processes; its output goes straight to ours. Past the
    deadline (plus a grace period) the whole process group is stopped."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", __file__,
           *argv, "--worker", "--results", str(results), "--deadline", str(deadline)]
    proc = subprocess.Popen(cmd, start_new_session=True)  # its own group: a stop reaches the workers too
    try:
        return "ok" if proc.wait(timeout=max(deadline - time.time(), 0) + 45) == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        return "stopped at the deadline"


def summarise(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each measured run with its scaling: total tokens/s over the one-process run's at the same batch."""
    single = {r["batch_size"]: r["tokens_per_s_total"] for r in records
              if r.get("kind") == "run" and r["variant"] == SINGLE and "tokens_per_s_total" in r}
    runs = []
    for r in records:
        if r.get("kind") != "run":
            continue
        base = single.get(r["batch_size"])
        scaling = r["tokens_per_s_total"] / base if base and "tokens_per_s_total" in r else None
        runs.append({**r, "scaling": scaling})
    return runs


def print_table(runs: list[dict[str, Any]]) -> None:
    print("\n| per-process batch | processes | variant | ms/step | tokens/s per process | tokens/s total | scaling "
          "| loss | first step s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in sorted(runs, key=lambda r: (-r["batch_size"], r["nproc"])):
        if "tokens_per_s_total" not in r:
            why = r.get("error") or r.get("skipped")
            print(f"| {r['batch_size']} | {r['nproc']} | {r['variant']} | {why} | | | | | |")
            continue
        per = " / ".join(f"{x:,.0f}" for x in r["tokens_per_s_per_process"])
        scale = f"{r['scaling']:.2f}x" if r["scaling"] is not None else "-"
        print(f"| {r['batch_size']} | {r['nproc']} | {r['variant']} | {r['ms_per_step']:.1f} | {per} | "
              f"{r['tokens_per_s_total']:,.0f} | {scale} | {r['loss']:.4f} | {r['first_step_s']:.1f} |")
    print("\nscaling: N processes' total tokens/s over one process's at the same per-process batch "
          "(issue 15: >= 1.9x at 256 and >= 1.8x at 128 on 2 GPUs)")


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    deadline = time.time() + args.budget_s
    out = args.json or (Path(os.environ["OUT"]) / "ddp_scaling.json" if os.environ.get("OUT") else None)
    topo = topology() if args.device != "cpu" else None
    if topo:
        print(f"nvidia-smi topo -m:\n{topo}", flush=True)
    report: dict[str, Any] = {"arguments": {k: v for k, v in vars(args).items() if k not in ("worker", "results",
                                                                                            "deadline", "json")},
                              "topology": topo, "launches": {}}
    records: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in args.nprocs:
            results = Path(tmp) / f"n{nproc}.jsonl"
            results.touch()
            print(f"\n== {nproc} process{'es' if nproc > 1 else ''} ==", flush=True)
            report["launches"][str(nproc)] = run_torchrun(nproc, argv, results, deadline)
            records += [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
            report["environment"] = [r for r in records if r["kind"] == "environment"]
            report["allreduce"] = [r for r in records if r["kind"] == "allreduce"]
            report["runs"] = summarise(records)
            if out:
                Path(out).parent.mkdir(parents=True, exist_ok=True)
                Path(out).write_text(json.dumps(report, indent=2) + "\n")
    print_table(report.get("runs", []))
    if out:
        print(f"wrote {out}")
    failed = [n for n, how in report["launches"].items() if how != "ok"]
    return 1 if failed else 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--nprocs", type=ints, default=[1, 2], help="process counts, in turn (1: the baseline)")
    p.add_argument("--batch-sizes", type=ints, default=[256, 128], help="sequences per process per micro-batch")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help="DDP variants, comma-separated (see the top)")
    p.add_argument("--steps", type=int, default=20, help="timed optimiser steps per measurement")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (compilation, DDP's bucket rebuild)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (all but the last under no_sync)")
    p.add_argument("--preset", default="base")
    p.add_argument("--vocab-size", type=int, default=30522, help="as bert-base-uncased")
    p.add_argument("--seq-len", type=int, default=128, help="synthetic row length; compiled, what batches pad to")
    p.add_argument("--max-predictions", type=int, default=20, help="MLM slots per sequence (BERT at 128: 20)")
    p.add_argument("--batches", default=None, help="real batches saved by bench/train_throughput.py --save-batches")
    p.add_argument("--pool", type=int, default=4, help="distinct batches per process, taken in turn")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="after the timed steps, this many more under torch.profiler: GPU busy time and the CPU's "
                        "busiest operators per step (printed and in the JSON)")
    p.add_argument("--trace-dir", default=None,
                   help="with --profile-steps, also a gzipped Chrome trace of each rank under DIR/VARIANT-bBATCH/")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", help="auto (cuda when available), cuda or cpu")
    p.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"), help="auto: bf16 on GPU")
    p.add_argument("--compile", default="auto", choices=("auto", "on", "off"), help="auto: on for cuda, as trained")
    p.add_argument("--no-unpad", dest="unpad", action="store_false", help="padded batches (the trainer's --no-unpad)")
    p.add_argument("--budget-s", type=float, default=510,
                   help="start no measurement that would end later than this many seconds after launch")
    p.add_argument("--json", default=None, help="write results here (default: $OUT/ddp_scaling.json)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--results", default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=float("inf"), help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if args.warmup < 1 or args.steps < 1:
        raise SystemExit("--warmup and --steps must be at least 1 (the first step compiles)")
    for v in args.variants.split(","):
        parse_variant(v)  # a typo fails here, not after the one-process run
    if args.worker:
        return worker(args)
    return launch(args, argv)


if __name__ == "__main__":
    sys.exit(main())
