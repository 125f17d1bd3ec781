"""Time to quality: held-out MLM accuracy against wall-clock minutes, our trainer against `transformers`'
BertForPreTraining + torch.compile, on the same corpus, batches, initial weights, optimiser, schedule and
evaluation. Only the model differs, so the curves answer two questions: does padding removal, the
sparse MLM head and the last layer's subset cost quality (equal accuracy at equal steps), and how much
sooner do we reach the reference's accuracy (equal accuracy at less time).

    python bench/time_to_quality.py --minutes 8 --preset base --batch-size 256 --out OUT   # both arms, in turn
    python bench/time_to_quality.py --arms ours --device-ids 0 ... / --arms reference --device-ids 1 ...
    python bench/time_to_quality.py --arms reference,ours --until-reference --minutes 30 ...  # ours stops there
    python bench/time_to_quality.py --report OUT                                             # table + plot again

Both arms go through `training.trainer.train` (bf16 autocast, fused AdamW, warm-up + linear decay); the
reference is wrapped so that train() can call it: labels over all positions, as `transformers` computes
them, and its logits of the masked positions for the shared evaluation. Each arm runs in its own
process for `--minutes` of training and is then stopped; wall-clock excludes the held-out evaluations
(they differ in cost between the arms and are not training) but includes compilation and data waits.
Writes OUT/<arm>/metrics.jsonl, OUT/time_to_quality.json and OUT/time_to_quality.png.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

ARMS = ("ours", "reference")


class ReferenceModel:
    """transformers.BertForPreTraining behind our BertForPreTraining's call signature (padded batches)."""

    @staticmethod
    def build(model_config):
        import torch
        import torch.nn.functional as F
        import transformers
        from torch import nn

        from training.model import PreTrainingOutput

        class _Wrapped(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                hf_config = transformers.BertConfig(**model_config.to_hf_dict())
                hf_config._attn_implementation = "sdpa"
                self.hf = transformers.BertForPreTraining(hf_config)

            def forward(self, input_ids, token_type_ids, attention_mask, mlm_labels=None, nsp_labels=None,
                        masked_positions=None, packed=None):
                assert packed is None, "the reference runs padded batches (--no-unpad)"
                # [B, P] labels of masked_positions -> [B, S] labels with -100 elsewhere, as transformers takes them.
                # Unused slots point at [CLS] (never masked) with label -100, so they write -100 there.
                labels = torch.full_like(input_ids, -100).scatter(1, masked_positions, mlm_labels)
                out = self.hf(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask,
                              labels=labels, next_sentence_label=nsp_labels)
                logits = out.prediction_logits  # [B, S, V]
                index = masked_positions.unsqueeze(-1).expand(-1, -1, logits.shape[-1])
                picked = logits.gather(1, index).flatten(0, 1)  # [B*P, V], aligned with mlm_labels.flatten()
                nsp_loss = F.cross_entropy(out.seq_relationship_logits.float(), nsp_labels)
                return PreTrainingOutput(out.loss, out.loss - nsp_loss, nsp_loss, picked, out.seq_relationship_logits)

        return _Wrapped()


def run_arm(args: argparse.Namespace) -> None:
    """One arm in this process: prepare the data (cached), build the model from the shared seed, train
    (or, with --step-times, time its steps)."""
    from training.data import DataConfig, prepare_data
    from training.trainer import Phase, TrainConfig, setup_distributed, train

    dist = setup_distributed(args.device)
    data = prepare_data(DataConfig(corpus=tuple(args.corpus), max_seq_len=args.max_seq_len,
                                   heldout_fraction=args.heldout_fraction, cache_dir=args.cache_dir),
                        show_progress=False)
    model = build_model(args, data.tokenizer.get_vocab_size())
    cfg = TrainConfig(batch_size=args.batch_size, lr=args.lr, warmup_steps=args.warmup_steps, seed=args.seed,
                      log_every=args.eval_every, eval_every=args.eval_every, eval_batches=args.eval_batches,
                      checkpoint_every=0, compile=True, unpad=args.arm == "ours", data_workers=args.data_workers,
                      cuda_graphs=args.cuda_graphs and args.arm == "ours")
    phase = Phase(name="phase1", train=data.train, heldout=data.heldout, steps=args.steps,
                  max_seq_len=args.max_seq_len, max_predictions=20, batch_size=args.batch_size)
    run_dir = Path(args.out) / args.arm
    if args.step_times:
        record = step_times(model, phase, cfg, dist, args.step_times)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "step_times.json").write_text(json.dumps(record, indent=2) + "\n")
        print(f"{args.arm}: " + json.dumps(record))
        return
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    train(model, [phase], cfg, dist, run_dir, checkpoint_meta={}, show_progress=False)


def build_model(args: argparse.Namespace, vocab_size: int):
    """The arm's model, from the same seeded initial weights: the reference loads ours."""
    import torch

    from training.model import BertForPreTraining, preset_config

    config = preset_config(args.preset, vocab_size=vocab_size)
    torch.manual_seed(args.seed)
    ours = BertForPreTraining(config)
    if args.arm == "ours":
        return ours
    model = ReferenceModel.build(config)
    missing, unexpected = model.hf.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("position_ids" in k or "decoder" in k for k in missing), (missing, unexpected)
    return model


def step_times(model, phase, cfg, dist, steps: int) -> dict:
    """Where an arm's step goes: ms per optimiser step through the trainer's own data path (its worker
    processes, the copy to the device), the same from batches prepared beforehand, and torch.profiler's
    view of a few steps of each (GPU busy per step: well under the step time means the GPU waits)."""
    from bench.ddp_scaling import PreparedBatches, profile_steps, timed_steps
    from training.optim import WarmupLinearDecay, make_optimizer
    from training.trainer import LogWindow, TrainState, batch_stream, build_learner

    model.to(dist.device).train()
    optimizer = make_optimizer(model, cfg.lr, cfg.weight_decay, dist.device)
    schedule = WarmupLinearDecay(optimizer, cfg.lr, cfg.warmup_steps, phase.steps)
    learner = build_learner(model, optimizer, schedule, cfg, dist)
    window = LogWindow(dist.device)
    record: dict = {}
    with batch_stream(phase, TrainState(), cfg, dist) as stream:
        pool = PreparedBatches([stream.next() for _ in range(16)])
        for name, source in (("trainer_data_path", stream), ("prepared_batches", pool)):
            timed_steps(learner, source, window, cfg, dist, 30)  # compilation and warm-up
            window.close(dist)
            elapsed = timed_steps(learner, source, window, cfg, dist, steps)
            totals = window.close(dist)
            profiled = profile_steps(learner, source, window, cfg, dist, 5)
            window.close(dist)
            record[name] = {"ms_per_step": elapsed / steps * 1e3,
                            "data_wait_ms_per_step": totals.data_wait_s / steps * 1e3,
                            "tokens_per_s": totals.tokens / elapsed, **profiled}
    return record


def curve(metrics: Path) -> list[dict]:
    """Held-out evaluations with the training wall-clock at each: a train line and an eval line share a
    step; the gap between them is evaluation time, subtracted from everything after."""
    events = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    train_at = {e["step"]: e for e in events if e["event"] == "train"}
    points, eval_total = [], 0.0
    for e in events:
        if e["event"] != "eval" or e["step"] not in train_at:
            continue
        t = train_at[e["step"]]
        points.append({"step": e["step"], "minutes": (t["elapsed_s"] - eval_total) / 60,
                       "mlm_accuracy": e["mlm_accuracy"], "nsp_accuracy": e["nsp_accuracy"],
                       "mlm_baseline_accuracy": e["mlm_baseline_accuracy"]})
        eval_total += e["time"] - t["time"]
    return points


def has_reached(metrics: Path, accuracy: float) -> bool:
    """Whether a running arm's held-out MLM accuracy has reached `accuracy` (its last line may be half
    written)."""
    try:
        return metrics.is_file() and any(p["mlm_accuracy"] >= accuracy for p in curve(metrics))
    except ValueError:
        return False


def _wait(procs: list[subprocess.Popen], deadline: float, stop=None) -> None:
    """Until every arm has ended, the deadline has passed or `stop()` says so; arms still running are
    then stopped."""
    while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
        if stop is not None and stop():
            break
        time.sleep(2)
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()


def time_to_reach(points: list[dict], accuracy: float) -> float | None:
    """Minutes until the held-out MLM accuracy first reaches `accuracy`, linearly interpolated."""
    previous = None
    for p in points:
        if p["mlm_accuracy"] >= accuracy:
            if previous is None:
                return p["minutes"]
            span = p["mlm_accuracy"] - previous["mlm_accuracy"]
            frac = (accuracy - previous["mlm_accuracy"]) / span if span > 0 else 1.0
            return previous["minutes"] + frac * (p["minutes"] - previous["minutes"])
        previous = p
    return None


def report(out: Path) -> dict:
    curves = {arm: curve(out / arm / "metrics.jsonl") for arm in ARMS if (out / arm / "metrics.jsonl").is_file()}
    result: dict = {"curves": curves}
    if set(curves) == set(ARMS) and curves["reference"] and curves["ours"]:
        ref, ours = curves["reference"], curves["ours"]
        final = ref[-1]
        ours_at = {p["step"]: p for p in ours}
        same_steps = [(p["step"], ours_at[p["step"]]["mlm_accuracy"] - p["mlm_accuracy"]) for p in ref
                      if p["step"] in ours_at]
        reached = time_to_reach(ours, final["mlm_accuracy"])
        result["summary"] = {
            "reference_minutes": final["minutes"], "reference_accuracy": final["mlm_accuracy"],
            "ours_minutes_to_reference_accuracy": reached,
            "time_ratio": reached / final["minutes"] if reached is not None else None,
            "ours_accuracy_at_reference_minutes": _accuracy_at(ours, final["minutes"]),
            "accuracy_difference_at_equal_steps": same_steps,
            "largest_difference_at_equal_steps": max((abs(d) for _, d in same_steps), default=None),
        }
    (out / "time_to_quality.json").write_text(json.dumps(result, indent=2) + "\n")
    _print_table(curves, result.get("summary"))
    _plot(curves, out / "time_to_quality.png")
    return result


def _accuracy_at(points: list[dict], minutes: float) -> float | None:
    before = [p for p in points if p["minutes"] <= minutes]
    return before[-1]["mlm_accuracy"] if before else None


def _print_table(curves: dict, summary: dict | None) -> None:
    steps = sorted({p["step"] for c in curves.values() for p in c})
    at = {arm: {p["step"]: p for p in c} for arm, c in curves.items()}
    print("| step | " + " | ".join(f"{a} min | {a} MLM acc" for a in curves) + " |")
    print("| --- |" + " --- | --- |" * len(curves))
    for s in steps:
        cells = []
        for arm in curves:
            p = at[arm].get(s)
            cells += [f"{p['minutes']:.2f}", f"{p['mlm_accuracy']:.4f}"] if p else ["", ""]
        print(f"| {s} | " + " | ".join(cells) + " |")
    if summary:
        print(json.dumps(summary, indent=2))


def _plot(curves: dict, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no {path.name} (rerun with --report where it is)")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(11, 4))
    for arm, points in curves.items():
        label = {"ours": "bertserve trainer", "reference": "transformers BertForPreTraining + compile"}[arm]
        by_time.plot([p["minutes"] for p in points], [p["mlm_accuracy"] for p in points], marker=".", label=label)
        by_step.plot([p["step"] for p in points], [p["mlm_accuracy"] for p in points], marker=".", label=label)
    for ax, xlabel in ((by_time, "training wall-clock (minutes, evaluation excluded)"), (by_step, "optimiser steps")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out MLM accuracy")
        ax.grid(alpha=0.3)
    by_time.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--report", action="store_true", help="only redo the table and plot from OUT")
    p.add_argument("--arms", default="ours,reference", help="comma-separated: ours, reference")
    p.add_argument("--device-ids", default=None,
                   help="comma-separated CUDA devices, one per arm: the arms then run at the same time")
    p.add_argument("--minutes", type=float, default=8.0, help="training wall-clock per arm before it is stopped")
    p.add_argument("--corpus", nargs="*", default=[])
    p.add_argument("--cache-dir", default=".cache/bertserve")
    p.add_argument("--preset", default="base")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup-steps", type=int, default=1000)
    p.add_argument("--steps", type=int, default=20000, help="the schedule's length (decay to 0 at this step)")
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--heldout-fraction", type=float, default=0.05, help="documents held out for evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--data-workers", type=int, default=None, help="the trainer's default when left out")
    p.add_argument("--cuda-graphs", action="store_true", help="our arm trains with --cuda-graphs")
    p.add_argument("--until-reference", action="store_true",
                   help="with --arms reference,ours (in turn): stop ours as soon as it reaches the reference's "
                        "final held-out MLM accuracy, instead of after --minutes (saves the GPU's time)")
    p.add_argument("--step-times", type=int, default=0, metavar="STEPS",
                   help="instead of training: time STEPS steps of each arm through the trainer's data path and "
                        "from prepared batches, with GPU busy time (writes OUT/<arm>/step_times.json)")
    p.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # internal: run one arm in this process
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.arm:
        run_arm(args)
        return 0
    if not args.report:
        out.mkdir(parents=True, exist_ok=True)
        arms = [a for a in args.arms.split(",") if a]
        devices = args.device_ids.split(",") if args.device_ids else None
        forwarded = [a for a in (argv if argv is not None else sys.argv[1:])
                     if a not in ("--report",)]
        # Data preparation once, before any clock starts (the arms then find it in the cache).
        from training.data import DataConfig, prepare_data
        prepare_data(DataConfig(corpus=tuple(args.corpus), max_seq_len=args.max_seq_len, cache_dir=args.cache_dir))
        if args.until_reference and (devices or arms != ["reference", "ours"]):
            p.error("--until-reference runs the arms in turn, the reference first: --arms reference,ours "
                    "without --device-ids")
        batches = [arms] if devices else [[a] for a in arms]
        for group in batches:  # --step-times: each arm in turn, or at once with --device-ids
            procs = []
            for i, arm in enumerate(group):
                env = dict(os.environ)
                if devices:
                    env["CUDA_VISIBLE_DEVICES"] = devices[i]
                procs.append(subprocess.Popen([sys.executable, __file__, *forwarded, "--arm", arm], env=env,
                                              start_new_session=True))
            reached = None
            if args.until_reference and group == ["ours"]:
                target = curve(out / "reference" / "metrics.jsonl")[-1]["mlm_accuracy"]
                reached = functools.partial(has_reached, out / "ours" / "metrics.jsonl", target)
            _wait(procs, time.monotonic() + args.minutes * 60 + 60, reached)  # + start-up, data loading
    if not args.step_times:
        report(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
