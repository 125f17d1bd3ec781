"""The optimiser and learning-rate schedule of pre-training: AdamW (no decay on biases and LayerNorm
weights, as in BERT) and linear warm-up followed by linear decay to zero."""
from __future__ import annotations

import torch
from torch import nn


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: matrices and embeddings decay; biases and LayerNorm weights (every 1-D
    parameter) do not. Tied parameters appear once (`named_parameters` de-duplicates them)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_optimizer(model: nn.Module, lr: float, weight_decay: float, device: torch.device) -> torch.optim.AdamW:
    # BERT's Adam: beta2 0.999, eps 1e-6. The fused kernel: one launch for all parameters on GPU, and
    # about twice as fast as the default per-tensor loop on CPU.
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=(0.9, 0.999), eps=1e-6,
                             fused=fused or None)


class WarmupLinearDecay:
    """lr(step) = peak * step / warmup during warm-up, then falls linearly to 0 at `total_steps`.

    Kept as plain state (the step count) instead of a LambdaLR, so a resumed run recomputes the shape
    from its own flags (e.g. a longer --max-steps) and stores nothing but where it is."""

    def __init__(self, optimizer: torch.optim.Optimizer, peak_lr: float, warmup_steps: int, total_steps: int):
        if total_steps <= 0:
            raise ValueError(f"total steps must be positive, got {total_steps}")
        if not 0 <= warmup_steps <= total_steps:
            raise ValueError(f"warm-up steps must lie in [0, {total_steps}], got {warmup_steps}")
        self.optimizer = optimizer
        self.peak_lr = peak_lr
        self.warmup_steps = warmup_steps
        self.total_steps = total_steps
        self.step_count = 0
        self._apply()

    def lr_at(self, step: int) -> float:
        """Learning rate used by optimiser step number `step` (0-based)."""
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        remaining = self.total_steps - self.warmup_steps
        if remaining <= 0:
            return self.peak_lr
        return self.peak_lr * max(0.0, (self.total_steps - step) / remaining)

    def _apply(self) -> None:
        lr = self.lr_at(self.step_count)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    @property
    def lr(self) -> float:
        return self.lr_at(self.step_count)

    def step(self) -> None:
        """Call after each optimiser step: sets the learning rate of the next one."""
        self.step_count += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])
        self._apply()
