"""Optimisers at the same token budget: AdamW, Muon, SOAP and LAMB train gpt_pydocs' GPT on Python's docs, each at
the best of three learning rates, and the steps each needs to reach AdamW's final validation loss.

    python benchmarks/optimizers.py
    python benchmarks/optimizers.py --steps 300 --val-every 25 --val-batches 20
    python benchmarks/optimizers.py --optimisers adamw,muon --steps 40 --val-every 10   # a short version

Every run is ``python train.py recipe=gpt_pydocs optim=NAME optim.lr=LR`` (``recipe=gpt_pydocs_muon`` for Muon
and SOAP) in a subprocess, one process with one
thread, fp32, with the same seed, batch, schedule (cosine, 5% warm-up), clipping and number of steps, so every
optimiser sees the same tokens. Muon and SOAP step the hidden matrices; the embeddings (tied with the head), norms
and biases go to their AdamW side at gpt_pydocs' AdamW settings (lr 2e-3, betas 0.9/0.99, weight decay 0.1), as
``recipe=gpt_pydocs_muon`` has it; every optimiser's weight decay is 0.1. The learning rates swept (``SWEEP``)
halve and double each optimiser's usual value; the best is the one with the lowest validation loss at the last
step (the table says where it is the smallest or largest rate swept).

The validation loss is measured every ``--val-every`` steps on the same first ``--val-batches`` batches of the
validation split. Prints each learning rate's final validation loss, then for each optimiser at its best rate: the
validation loss at four fixed steps, the first validation step at or below AdamW's final validation loss (or
"not reached") and that step over AdamW's, the training time per step and the optimiser's share of it. The share
is measured, not estimated: a callback times ``optimizer.step`` from the moment the closure (forward, backward,
clipping) has returned to the step's end, i.e. the update itself, Muon's orthogonalisation and SOAP's
preconditioning included. Time per step and share are the median of an optimiser's three runs. Writes the
validation curves as a plot; the last line is the headline: Muon's and SOAP's steps to AdamW's loss as a ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

from machine import cpu_model  # noqa: E402

SWEEP = {
    "adamw": (1e-3, 2e-3, 4e-3),  # around gpt_pydocs' 2e-3
    "muon": (0.01, 0.02, 0.04),  # around gpt_pydocs_muon's (and torch's Muon's) 0.02
    "soap": (1.5e-3, 3e-3, 6e-3),  # around SOAP's usual 3e-3 (the paper's, conf/optim/soap.yaml's)
    "lamb": (5e-3, 0.01, 0.02),  # around lamb_large_batch's 0.01
}
"""The learning rates swept for each optimiser: half, once and twice its usual value."""

RECIPES = {"adamw": "gpt_pydocs", "lamb": "gpt_pydocs", "muon": "gpt_pydocs_muon", "soap": "gpt_pydocs_muon"}
"""The recipe each optimiser's runs start from: the same model, data, batch and schedule; gpt_pydocs_muon adds the
AdamW side of a matrix optimiser at gpt_pydocs' AdamW settings."""

RUN = ["trainer.precision=32-true", "trainer.check_val_every_n_epoch=null",
       "trainer.run_test=false", "optim.weight_decay=0.1", "logger=csv", "plots=false", "energy=false", "expect=null",
       "checkpoint.save_last=false", "checkpoint.save_top_k=0", "+callbacks.step_clock._target_=optimizers.StepClock"]
"""Overrides of every run: the recipe's model, data, batch and schedule in fp32 (the same arithmetic on every
CPU), its weight decay for every optimiser, no test, checkpoint or plot, and the optimiser-step clock."""


class StepClock(pl.Callback):
    """Times the update of every optimiser step: from the end of the closure (forward, backward, clipping) to the
    end of ``optimizer.step``; rank 0 writes the step count and the mean seconds (the first step left out, as the
    run's throughput leaves it out) to ``out`` as JSON when training ends."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.seconds: list[float] = []

    def on_train_start(self, trainer: pl.Trainer, *_: Any) -> None:
        """Wrap each optimiser's ``step`` with the clock."""
        for optimizer in trainer.optimizers:
            optimizer.step = self._timed(optimizer.step, trainer.strategy.root_device.type == "cuda")

    def _timed(self, step: Any, on_gpu: bool) -> Any:
        """``step`` that appends the seconds of its update (after the closure) to ``self.seconds``."""
        import torch

        def now() -> float:
            if on_gpu:  # the update's kernels run asynchronously: wait for them before each reading
                torch.cuda.synchronize()
            return time.perf_counter()

        def timed_step(closure: Any = None, **kwargs: Any) -> Any:
            started = [now()]

            def timed_closure() -> Any:
                result = closure()
                started[0] = now()
                return result

            result = step(closure=timed_closure if closure is not None else None, **kwargs)
            self.seconds.append(now() - started[0])
            return result

        return timed_step

    def on_train_end(self, trainer: pl.Trainer, *_: Any) -> None:
        """Write the mean update time (rank 0)."""
        if trainer.is_global_zero:
            measured = self.seconds[1:]
            Path(self.out).write_text(json.dumps({"steps": len(measured),
                                                  "mean_s": statistics.fmean(measured) if measured else None}))


def train(optimiser: str, lr: float, steps: int, val_every: int, val_batches: int, run_dir: Path) -> dict[str, Any]:
    """One run: its validation curve, training seconds per step and mean update seconds."""
    clock = run_dir / "step_clock.json"
    args = [f"recipe={RECIPES[optimiser]}", *RUN, f"optim={optimiser}", f"optim.lr={lr:g}",
            f"trainer.max_steps={steps}", f"trainer.val_check_interval={val_every}",
            f"trainer.limit_val_batches={val_batches}", f"+callbacks.step_clock.out={clock}",
            f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(HERE)])}
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    from disttrain.report.plots import logged_series

    results = json.loads((run_dir / "results.json").read_text())
    return {"val": logged_series(run_dir / "csv" / "metrics.csv", ("val/loss",))["val/loss"],
            "step_s": results["batch"]["global"] / results["samples_per_sec"],
            "update_s": json.loads(clock.read_text())["mean_s"]}


def steps_to(curve: list[tuple[float, float]], target: float) -> int | None:
    """The first validation step whose loss is at or below ``target``; None where none is."""
    return next((int(step) for step, loss in curve if loss <= target), None)


def loss_at(curve: list[tuple[float, float]], step: int) -> float | None:
    """The validation loss measured at ``step``, if it was measured there."""
    return next((loss for at, loss in curve if int(at) == step), None)


def edge(lr: float, swept: tuple[float, ...]) -> str:
    """A note where ``lr`` is the smallest or largest rate swept: the best may lie beyond it."""
    return " (edge of the sweep)" if lr in (min(swept), max(swept)) else ""


def write_plot(best: dict[str, dict[str, Any]], swept: dict[str, list[tuple[float, dict]]], target: float,
               path: Path) -> Path | None:
    """Validation loss against steps: each optimiser's best rate as a line with dots, its other rates faint, and
    AdamW's final loss as a dashed line; None without matplotlib."""
    from disttrain.report.plots import pyplot, save

    plt = pyplot()
    if plt is None:
        return None
    figure, axes = plt.subplots(figsize=(8, 5))
    for (name, run), colour in zip(best.items(), plt.get_cmap("tab10").colors, strict=False):
        for _, other in swept[name]:
            if other is not run:
                axes.plot(*zip(*other["val"], strict=True), "-", color=colour, alpha=0.25, linewidth=1)
        axes.plot(*zip(*run["val"], strict=True), "o-", color=colour, markersize=3, linewidth=1.5,
                  label=f"{name}, lr {run['lr']:g}")
    axes.axhline(target, linestyle="--", color="grey", linewidth=1, label=f"AdamW's final {target:.4f}")
    axes.set_xlabel("optimiser step (same tokens per step for every run)")
    axes.set_ylabel("validation cross-entropy (nats)")
    axes.set_title("GPT nano on pydocs: best learning rate of each optimiser (faint: the other two)")
    top = max(run["val"][0][1] for run in best.values())
    axes.set_ylim(min(loss for run in best.values() for _, loss in run["val"]) - 0.05, min(top, 3.5))
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    return save(figure, plt, path)


def main() -> None:
    """Sweep, pick each optimiser's best rate, print the tables and the headline, draw the curves."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--optimisers", default=",".join(SWEEP), help="comma-separated, of " + ", ".join(SWEEP)
                        + "; adamw first (its final loss is the target)")
    parser.add_argument("--steps", type=int, default=300, help="optimiser steps of every run")
    parser.add_argument("--val-every", type=int, default=25, help="steps between validations")
    parser.add_argument("--val-batches", type=int, default=20, help="validation batches (the same every time)")
    parser.add_argument("--plot", type=Path, default=ROOT / "outputs" / "optimizers_curves.png")
    args = parser.parse_args()
    names = args.optimisers.split(",")
    if names[0] != "adamw" or any(name not in SWEEP for name in names):
        parser.error(f"--optimisers {args.optimisers}: adamw first, then any of {', '.join(SWEEP)}")
    swept: dict[str, list[tuple[float, dict]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            swept[name] = []
            for lr in SWEEP[name]:
                started = time.perf_counter()
                run = {"lr": lr, **train(name, lr, args.steps, args.val_every, args.val_batches,
                                         Path(tmp) / f"{name}-{lr:g}")}
                swept[name].append((lr, run))
                print(f"  {name} lr {lr:g}: val/loss {run['val'][-1][1]:.4f}, {run['step_s'] * 1e3:.0f} ms/step "
                      f"({time.perf_counter() - started:.0f} s)", flush=True)
    best = {name: min((run for _, run in runs), key=lambda run: run["val"][-1][1]) for name, runs in swept.items()}
    target = best["adamw"]["val"][-1][1]
    adamw_steps = steps_to(best["adamw"]["val"], target)
    tokens = 32 * 64 * args.steps
    print(f"\nCPU: {cpu_model()}; gpt_pydocs' GPT nano on pydocs, 1 process, 1 thread, fp32, global batch 32 x 64 "
          f"tokens, {args.steps} steps ({tokens:,} tokens), cosine schedule with 5% warm-up, clipping at 1.0, "
          f"seed 0; validation loss on the same {args.val_batches} batches every {args.val_every} steps\n")
    print("| optimiser | " + " | ".join(f"lr {i + 1}" for i in range(3)) + " | best |")
    print("|---|---|---|---|---|")
    for name, runs in swept.items():
        print(f"| {name} | " + " | ".join(f"{lr:g}: {run['val'][-1][1]:.4f}" for lr, run in runs)
              + f" | {best[name]['lr']:g}{edge(best[name]['lr'], SWEEP[name])} |")
    marks = [args.steps // 4 // args.val_every * args.val_every, args.steps // 2 // args.val_every * args.val_every,
             3 * args.steps // 4 // args.val_every * args.val_every, args.steps]
    print("\n| optimiser | lr | " + " | ".join(f"val loss at {mark}" for mark in marks)
          + f" | steps to AdamW's {target:.4f} | vs AdamW | ms per step | optimiser step's share |")
    print("|---|---|" + "---|" * len(marks) + "---|---|---|---|")
    ratios = {}
    for name, run in best.items():
        reached = steps_to(run["val"], target)
        ratios[name] = reached / adamw_steps if reached and adamw_steps else None
        step_s = statistics.median(other["step_s"] for _, other in swept[name])
        share = statistics.median(other["update_s"] / other["step_s"] for _, other in swept[name])
        losses = [loss_at(run["val"], mark) for mark in marks]
        print(f"| {name} | {run['lr']:g} | " + " | ".join(f"{loss:.4f}" if loss is not None else "" for loss in losses)
              + f" | {reached if reached else 'not reached'} | "
              + (f"{ratios[name]:.2f}x" if ratios[name] else "") + f" | {step_s * 1e3:.0f} | {share:.1%} |")
    written = write_plot(best, swept, target, args.plot)
    print(f"\nplot: {written}" if written else "\nplot: not drawn (matplotlib is not installed)")
    headline = [f"{name} {f'{ratios[name]:.2f}x' if ratios[name] else 'not reached'}"
                for name in best if name != "adamw"]
    print(f"Headline: steps to AdamW's final validation loss {target:.4f} ({adamw_steps} steps) relative to AdamW's: "
          + ", ".join(headline))


if __name__ == "__main__":
    main()
