"""Training attention kernels side by side: forward + backward of one BERT-base attention layer (12 heads
of 64, bf16, dropout 0.1) over 256 sequences of pre-training lengths, for each kernel PyTorch offers:
FlashAttention's variable-length kernel (what training.packed runs), the memory-efficient kernel on the
same packed layout, and cuDNN / memory-efficient attention on the padded batch with a mask.

    python bench/attention_kernels.py            # on a GPU; prints ms per layer
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--mean-length", type=float, default=83.0, help="the default corpus: 65%% of 128")
    p.add_argument("--repeats", type=int, default=50)
    args = p.parse_args()
    torch.manual_seed(0)
    dev, b, s, heads, size = "cuda", args.batch_size, args.seq_len, 12, 64
    lengths = torch.clamp((torch.randn(b) * 30 + args.mean_length).round(), 16, s).int()
    t = int(lengths.sum())
    cu = F.pad(lengths.cumsum(0, dtype=torch.int32), (1, 0)).to(dev)
    print(f"{b} sequences, {t} tokens (mean length {float(lengths.float().mean()):.1f} of {s})")

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16, requires_grad=True)

    q, k, v, grad = tensor(t, heads, size), tensor(t, heads, size), tensor(t, heads, size), tensor(t, heads, size)
    qp, kp, vp, gradp = (tensor(b, heads, s, size) for _ in range(4))
    mask = (torch.arange(s, device=dev)[None] < lengths.to(dev)[:, None])[:, None, None, :]

    def flash_varlen() -> None:
        torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, s, s, 0.1, False, False)[0].backward(grad)

    def efficient_varlen() -> None:
        out = torch.ops.aten._efficient_attention_forward(q[None], k[None], v[None], None, cu, cu, s, s, 0.1, 0, True)
        out[0].backward(grad[None])

    def padded(backend: SDPBackend):
        def run() -> None:
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, dropout_p=0.1).backward(gradp)
        return run

    for name, run in [("flash, variable length (training.packed)", flash_varlen),
                      ("memory-efficient, variable length", efficient_varlen),
                      ("cuDNN, padded + mask", padded(SDPBackend.CUDNN_ATTENTION)),
                      ("memory-efficient, padded + mask", padded(SDPBackend.EFFICIENT_ATTENTION))]:
        try:
            for _ in range(5):
                run()
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(args.repeats):
                run()
            torch.cuda.synchronize()
            print(f"{name}: {(time.perf_counter() - started) / args.repeats * 1e3:.3f} ms forward + backward a layer")
        except RuntimeError as e:  # a kernel this card or build lacks
            print(f"{name}: not available ({str(e).splitlines()[0][:120]})")


if __name__ == "__main__":
    main()
