"""Where one compiled pre-training step of ours spends GPU time: torch.profiler over a few steps, the
kernels sorted by their own CUDA time (the table in BENCHMARKS.md comes from this).

    python bench/train_step_profile.py --preset base --batch-size 256 --seq-len 128   # on a GPU
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from a checkout

from bench.train_throughput import make_batch  # noqa: E402
from training.model import BertForPreTraining, preset_config  # noqa: E402
from training.model_inputs import model_inputs  # noqa: E402
from training.optim import make_optimizer  # noqa: E402
from training.trainer import autocast_context  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="base")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--max-predictions", type=int, default=20)
    p.add_argument("--steps", type=int, default=3, help="profiled steps (after 6 warm-up and 10 timed ones)")
    p.add_argument("--rows", type=int, default=45, help="table rows")
    args = p.parse_args()

    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    cfg = preset_config(args.preset, vocab_size=30522)
    masked = min(args.max_predictions, round(0.15 * args.seq_len))
    batch = make_batch(args.batch_size, args.seq_len, cfg.vocab_size, masked)
    torch.manual_seed(0)
    model = BertForPreTraining(cfg).to(device).train()
    opt = make_optimizer(model, 1e-4, 0.01, device)
    inputs = model_inputs(batch, args.max_predictions, device)
    run = torch.compile(model)

    def step() -> None:
        with autocast_context("auto", device):
            out = run(**inputs)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(6):
        step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    print(f"{(time.perf_counter() - started) / 10 * 1e3:.1f} ms/step")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            step()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=90))


if __name__ == "__main__":
    main()
