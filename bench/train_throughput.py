"""Pre-training throughput of our BertForPreTraining against `transformers`' on one device, same batch,
same process: tokens/s and model-FLOPs utilisation (MFU) of a full step (forward, backward, AdamW).

    python bench/train_throughput.py                                  # base, seq 128, batch 256, on cuda
    python bench/train_throughput.py --preset tiny --device cpu --steps 3 --batch-size 8   # smoke test
    python bench/train_throughput.py --save-batches B.npz --cache-dir .cache/bertserve     # real batches (CPU)
    python bench/train_throughput.py --batches B.npz                  # ... timed on the GPU

Synthetic batches are full length (no padding anywhere). Real batches come from the pre-training data
pipeline on the default corpus (`--save-batches`: the first batches of epoch 0, padded to their longest
row as the trainer gets them; about a third of their slots is padding). Both models get the same batches.

Ours runs as the trainer runs it (training.trainer: bf16 autocast, fused AdamW, torch.compile, MLM head
on a fixed-shape gather of the masked positions, padding removed; `--padded` also times it on the padded
batch). The reference is /work/shared/baselines/hf_pretraining.py:
transformers.BertForPreTraining, bf16 autocast, fused AdamW, torch.compile, `labels` over all positions.
Prints a table; writes JSON to $OUT/train_throughput.json when OUT is set (or to --json).
"""
from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from training.model import BertForPreTraining, preset_config  # noqa: E402
from training.model_inputs import model_inputs  # noqa: E402
from training.optim import make_optimizer  # noqa: E402
from training.trainer import autocast_context  # noqa: E402

# Dense bf16 tensor-core peak (no sparsity) by card; MFU is left out for cards not listed.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L4": 121e12, "GH200": 989e12}


def make_batch(batch: int, seq: int, vocab: int, masked_per_seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A full-length pair batch with exactly `masked_per_seq` masked positions per row (BERT: 15%)."""
    g = torch.Generator().manual_seed(seed)
    low = min(1000, vocab // 2)
    ids = torch.randint(low, vocab, (batch, seq), generator=g)
    token_types = (torch.arange(seq) >= seq // 2).long().expand(batch, seq).contiguous()
    labels = torch.full_like(ids, -100)
    cols = torch.rand(batch, seq - 1, generator=g).argsort(dim=1)[:, :masked_per_seq] + 1  # never [CLS]
    labels.scatter_(1, cols, ids.gather(1, cols))
    return {"input_ids": ids, "token_type_ids": token_types, "attention_mask": torch.ones_like(ids),
            "mlm_labels": labels, "nsp_labels": torch.randint(0, 2, (batch,), generator=g)}


def batch_flops(batch: dict[str, torch.Tensor], layers: int, hidden: int, vocab: int) -> float:
    """Useful training FLOPs of one batch: 6 x encoder matmul parameters per real token, attention scores
    and context (12·L·H per query-key pair of real tokens), and the MLM head (transform + vocabulary
    projection) on masked positions only. Padding is not useful work, whoever computes it."""
    lengths = batch["attention_mask"].sum(1).double()
    encoder = 6 * 12 * layers * hidden * hidden * lengths.sum()
    attention = 12 * layers * hidden * (lengths ** 2).sum()
    mlm_head = 6 * (hidden * hidden + hidden * vocab) * (batch["mlm_labels"] != -100).sum()
    return float(encoder + attention + mlm_head)


def save_batches(path: str, cache_dir: str, batch_size: int, count: int) -> None:
    """The first `count` training batches of the default corpus (built into `cache_dir` if not there)."""
    import numpy as np
    from training.data import DataConfig, prepare_data
    data = prepare_data(DataConfig(cache_dir=cache_dir))
    stream = data.train.batches(0, batch_size, seed=0)
    batches = [next(stream) for _ in range(count)]
    seq = max(b["input_ids"].shape[1] for b in batches)
    stacked = {k: np.stack([torch.nn.functional.pad(b[k], (0, seq - b[k].shape[1]), value=-100 if k == "mlm_labels"
                                                    else 0).numpy() for b in batches])
               for k in ("input_ids", "token_type_ids", "attention_mask", "mlm_labels")}
    stacked["nsp_labels"] = np.stack([b["nsp_labels"].numpy() for b in batches])
    np.savez_compressed(path, **{k: v.astype(np.int32) for k, v in stacked.items()})
    fill = stacked["attention_mask"].mean()
    print(f"wrote {count} batches of {batch_size} x {seq} to {path}: {fill:.1%} of the slots are tokens")


def load_batches(path: str) -> list[dict[str, torch.Tensor]]:
    import numpy as np
    arrays = np.load(path)
    return [{k: torch.from_numpy(arrays[k][i]).long() for k in arrays.files} for i in range(len(arrays["input_ids"]))]


def _time_steps(step, steps: int, warmup: int, device: torch.device) -> tuple[float, float, float]:
    """(seconds per step, compile/warm-up seconds, last loss)."""
    t0 = time.perf_counter()
    loss = None
    for _ in range(warmup):
        loss = step()
    _sync(device)
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    _sync(device)
    return (time.perf_counter() - t0) / steps, warm, float(loss)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_ours(cfg, batches, args, device, compile_model: bool, unpad: bool = True):
    torch.manual_seed(0)
    model = BertForPreTraining(cfg).to(device).train()
    opt = make_optimizer(model, 1e-4, 0.01, device)
    inputs = [model_inputs(b, args.max_predictions, device, unpad=unpad) for b in batches]
    run = torch.compile(model) if compile_model else model
    turns = itertools.cycle(inputs)

    def step():
        with autocast_context(args.precision, device):
            out = run(**next(turns))
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.detach()

    return _time_steps(step, args.steps, args.warmup, device)


def bench_reference(cfg, batches, args, device, compile_model: bool):
    """shared/baselines/hf_pretraining.py, reproduced: the same step on transformers' model."""
    import transformers
    torch.manual_seed(0)
    hf_cfg = transformers.BertConfig(**{k: v for k, v in cfg.to_hf_dict().items()
                                        if k not in ("architectures", "model_type")})
    model = transformers.BertForPreTraining(hf_cfg).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    on_device = [{k: v.to(device) for k, v in batch.items()} for batch in batches]
    run = torch.compile(model) if compile_model else model
    turns = itertools.cycle(on_device)

    def step():
        b = next(turns)
        with autocast_context(args.precision, device):
            out = run(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"],
                      attention_mask=b["attention_mask"], labels=b["mlm_labels"], next_sentence_label=b["nsp_labels"])
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.loss.detach()

    return _time_steps(step, args.steps, args.warmup, device)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="base")
    p.add_argument("--vocab-size", type=int, default=30522, help="as bert-base-uncased and the reference")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--max-predictions", type=int, default=20, help="MLM slots per sequence (BERT at 128: 20)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per engine")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (include compilation)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"),
                   help="auto: bf16 autocast on GPU, fp32 on CPU (the same for both models)")
    p.add_argument("--compile", default="auto", choices=("auto", "on", "off"), help="auto: on for cuda")
    p.add_argument("--eager", action="store_true", help="also time both models without torch.compile")
    p.add_argument("--no-reference", action="store_true", help="time ours only")
    p.add_argument("--padded", action="store_true", help="also time ours on the padded batch (no unpadding)")
    p.add_argument("--batches", default=None, help="real batches saved by --save-batches (default: synthetic)")
    p.add_argument("--save-batches", default=None, metavar="PATH",
                   help="write real batches of the default corpus to PATH (.npz) and exit")
    p.add_argument("--save-count", type=int, default=8, help="how many batches --save-batches writes")
    p.add_argument("--cache-dir", default=".cache/bertserve", help="data cache for --save-batches")
    p.add_argument("--json", default=None, help="write results here (default: $OUT/train_throughput.json)")
    args = p.parse_args(argv)
    if args.save_batches:
        save_batches(args.save_batches, args.cache_dir, args.batch_size, args.save_count)
        return 0

    device = torch.device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = True
    compiled = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    cfg = preset_config(args.preset, vocab_size=args.vocab_size)
    masked = min(args.max_predictions, round(0.15 * args.seq_len))
    if args.batches:
        batches = load_batches(args.batches)
        args.batch_size, args.seq_len = batches[0]["input_ids"].shape
    else:
        batches = [make_batch(args.batch_size, args.seq_len, cfg.vocab_size, masked)]
    flops = sum(batch_flops(b, cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) for b in batches) / len(batches)
    tokens = sum(int(b["attention_mask"].sum()) for b in batches) / len(batches)  # real tokens per batch
    fill = tokens / (args.batch_size * args.seq_len)
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in card), None)

    runs = [("ours", compiled, bench_ours)]
    if args.padded:
        runs.append(("ours, padded", compiled, lambda *a: bench_ours(*a, unpad=False)))
    if args.eager and compiled:
        runs.append(("ours", False, bench_ours))
    if not args.no_reference:
        runs.append(("transformers", compiled, bench_reference))
        if args.eager and compiled:
            runs.append(("transformers", False, bench_reference))

    print(f"{args.preset} (L={cfg.num_hidden_layers} H={cfg.hidden_size} V={cfg.vocab_size}), batch "
          f"{args.batch_size} x {args.seq_len}, {'real batches from ' + args.batches if args.batches else 'synthetic'}"
          f" ({fill:.1%} of slots are tokens), {args.precision} on {card}; "
          f"{args.warmup} warm-up + {args.steps} timed steps", flush=True)
    results = []
    for name, comp, fn in runs:
        sec, warm, loss = fn(cfg, batches, args, device, comp)
        tokens_per_s = tokens / sec
        tflops = flops / sec / 1e12
        results.append({
            "model": name, "compile": comp, "ms_per_step": sec * 1e3, "sequences_per_s": args.batch_size / sec,
            "tokens_per_s": tokens_per_s, "model_tflops": tflops, "mfu": tflops * 1e12 / peak if peak else None,
            "warmup_s": warm, "loss": loss,
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        })
        print(f"  {name:<12} {'compile' if comp else 'eager':<8} done: {tokens_per_s:,.0f} tok/s", flush=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)

    print(f"\n| model | mode | ms/step | seq/s | real tokens/s | model TFLOP/s | MFU | peak GiB | loss |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        mem = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "-"
        print(f"| {r['model']} | {'compile' if r['compile'] else 'eager'} | {r['ms_per_step']:.1f} | "
              f"{r['sequences_per_s']:,.0f} | {r['tokens_per_s']:,.0f} | {r['model_tflops']:.1f} | {mfu} | "
              f"{mem} | {r['loss']:.2f} |")
    speedup = None
    ours = next((r for r in results if r["model"] == "ours" and r["compile"] == compiled), None)
    ref = next((r for r in results if r["model"] == "transformers" and r["compile"] == compiled), None)
    if ours and ref:
        speedup = ours["tokens_per_s"] / ref["tokens_per_s"]
        print(f"\nours / transformers ({'compile' if compiled else 'eager'}): {speedup:.2f}x (target 1.7x)")
    print(f"useful FLOPs per batch (real tokens; MLM head on masked positions only): {flops / 1e12:.2f}T")

    report = {"card": card, "torch": torch.__version__, "preset": args.preset, "batch_size": args.batch_size,
              "seq_len": args.seq_len, "batches": args.batches or "synthetic", "token_fill": fill,
              "precision": args.precision, "flops_per_batch": flops, "peak_flops": peak, "results": results, "speedup": speedup}
    out = args.json or (Path(os.environ["OUT"]) / "train_throughput.json" if os.environ.get("OUT") else None)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
