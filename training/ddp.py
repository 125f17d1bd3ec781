"""How a model is wrapped for DistributedDataParallel: bucket size, gradients kept in the all-reduce
buckets, static graph, bf16 all-reduce, buffer broadcast and how a compiled model is split. The trainer
and bench/ddp_scaling.py both wrap through here, so that the benchmark measures what training runs."""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


@dataclass(frozen=True)
class DDPOptions:
    # All-reduce gradients in bf16: half the bytes between devices, but the averaged gradient is rounded
    # to bf16, so the numbers differ slightly from fp32's. Off: a choice that changes results is the user's.
    bf16_grads: bool = False
    bucket_mb: float | None = None  # gradients per all-reduce; None: torch's default (25 MB)
    # Gradients live in the all-reduce buckets instead of being copied back out of them: the same
    # numbers, one gradient-sized copy and buffer less. DDP's one caveat, detach_() on a gradient, never
    # happens here (zero_grad sets gradients to None).
    bucket_view: bool = True
    # DDP may assume the same parameters get gradients in the same order every step (true of
    # BertForPreTraining: every parameter is used every step). Off: without find_unused_parameters DDP
    # already reorders its buckets after the first step, so what it adds here is unmeasured. Never under
    # no_sync (gradient accumulation): torch's reducer then fails or stops averaging (pytorch/pytorch#143580,
    # #187732), so the trainer refuses it with --grad-accum above 1.
    static_graph: bool = False
    # Compiled (--compile), torch can split the DDP model's graph at bucket boundaries so that each bucket's
    # all-reduce overlaps the rest of the backward pass (dynamo's optimize_ddp, torch's default). Off: one
    # graph, and the all-reduces run after the backward pass. On two H100s one graph was faster at batch 128
    # (37-39 against 40-48 ms a step) and as fast at 256: the split graph's kernels ran 50% longer beside
    # the all-reduces than alone (BENCHMARKS.md, DDP on two GPUs).
    graph_per_bucket: bool = False
    # DDP's default sends rank 0's buffers to every rank before each forward pass: one more collective per
    # step, where each rank waits for the others. This model's only buffer is a constant (position ids).
    broadcast_buffers: bool = False

    def __post_init__(self) -> None:
        if self.bucket_mb is not None and not self.bucket_mb > 0:
            raise ValueError(f"--ddp-bucket-mb must be positive, got {self.bucket_mb}")


def wrap_ddp(model: nn.Module, device: torch.device, options: DDPOptions) -> DistributedDataParallel:
    """`model` (already on `device`) under DDP in the default process group, which must exist."""
    size = {} if options.bucket_mb is None else {"bucket_cap_mb": options.bucket_mb}  # torch's own default otherwise
    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                  gradient_as_bucket_view=options.bucket_view, static_graph=options.static_graph,
                                  **_buffer_sync(options.broadcast_buffers), **size)
    if options.bf16_grads:
        ddp.register_comm_hook(None, bf16_all_reduce)  # None: the default group
    return ddp


def _buffer_sync(each_step: bool) -> dict[str, bool]:
    """DDP's switch for sending rank 0's buffers before each forward pass: `forward_sync_buffers` where
    this torch has it (it deprecates `broadcast_buffers`, with a warning from every rank). Off, it still
    syncs them once at start, unlike `broadcast_buffers`: no matter for this model's one buffer, a constant."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": each_step}
    return {"broadcast_buffers": each_step}


def compile_ddp(ddp: DistributedDataParallel, options: DDPOptions, mode: str | None = None) -> nn.Module:
    """`ddp` under torch.compile (`mode` as torch.compile takes it), split at bucket boundaries or not as
    `options` say. optimize_ddp is dynamo's documented switch for this and is read when the model first
    runs, so it is set here, for the process: one process trains one model."""
    torch._dynamo.config.optimize_ddp = options.graph_per_bucket
    return torch.compile(ddp, mode=mode)


def bf16_all_reduce(group: torch_dist.ProcessGroup | None, bucket):
    """A DDP communication hook: the bucket averaged in bf16, as torch's bf16_compress_hook does. Ours
    because torch's refuses to register on a torch built without CUDA, which would leave this path
    untested on CPUs (gloo). `bucket` and the result (Future[Tensor]) carry no annotation: DDP compares
    annotations with the classes themselves, and this module's are strings."""
    buffer = bucket.buffer()  # fp32 gradients, flat
    compressed = buffer.to(torch.bfloat16).div_(torch_dist.get_world_size(group))

    def decompress(done: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(done.value()[0])  # in place: no second fp32 bucket
        return buffer

    return torch_dist.all_reduce(compressed, group=group, async_op=True).get_future().then(decompress)
