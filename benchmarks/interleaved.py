"""disttrain's one-process step against the plain loop's, the two interleaved step by step in one process.

    python benchmarks/interleaved.py --flavour cnn --steps 600
    python benchmarks/interleaved.py --flavour linear --steps 3000

``overhead.py`` times each side in a run of its own. On shared cores a run's speed drifts by far more than the 1%
that the one-process goal asks about (here the plain loop's own median step moved from 0.59 to 0.95 ms between
runs of 500 steps, one after the other). This script takes the drift out: disttrain trains as ``overhead.py``'s
one-process run does, and a callback runs one step of the plain loop (``reference_loops.PlainStepper``: its own
model, AdamW, clipping and schedule, batches indexed out of in-memory tensors) at the start of every disttrain
batch. Each disttrain step is the time from the end of one plain step to the start of the next (everything
disttrain and Lightning do in between, the callback's own dispatch included), each plain step the time it took,
so the two sides of a pair ran within milliseconds of each other. Reports, over the steps after ``--warmup``: the
ratio of the two sides' total times (what steps/s would show), of their median steps, the median of the pairs'
ratios, and the time disttrain adds per step (total and median).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fresh_process import in_fresh_process  # noqa: E402
from machine import cpu_model  # noqa: E402
from overhead import disttrain_results  # noqa: E402
from reference_loops import PlainStepper, workload_configs, workload_name  # noqa: E402


class PlainBeside(pl.Callback):
    """Runs one plain-loop step at the start of each disttrain batch; writes both sides' step times (seconds,
    JSON) to ``out`` at the end."""

    def __init__(self, out: str, flavour: str, steps: int, global_batch: int) -> None:
        from disttrain.data import build_datamodule
        from disttrain.models import build_model

        with torch.random.fork_rng():  # the plain side's initialisation draws nothing from disttrain's stream
            torch.manual_seed(0)
            data_cfg, model_cfg = workload_configs(flavour)
            datamodule = build_datamodule(data_cfg, micro_batch_size=global_batch, seed=0)
            datamodule.setup("fit")
            model = build_model(model_cfg, datamodule.spec)
            self.plain = PlainStepper(model, datamodule.datasets["train"], steps, global_batch)
        self.out, self.index = out, 0
        self.plain_steps: list[float] = []
        self.disttrain_steps: list[float] = []
        self.plain_ended: float | None = None

    def on_train_batch_start(self, *_: Any) -> None:
        """Close disttrain's step, run and time the plain loop's."""
        started = time.perf_counter()
        if self.plain_ended is not None:
            self.disttrain_steps.append(started - self.plain_ended)
        self.plain.step(self.index)
        self.index += 1
        self.plain_ended = time.perf_counter()
        self.plain_steps.append(self.plain_ended - started)

    def on_train_end(self, *_: Any) -> None:
        """Write the steps: ``disttrain[i]`` ran between ``plain[i]`` and ``plain[i + 1]``."""
        Path(self.out).write_text(json.dumps({"plain": self.plain_steps, "disttrain": self.disttrain_steps}))


def interleaved_run(flavour: str, steps: int, global_batch: int) -> dict[str, list[float]]:
    """Both sides' step times (seconds) from one disttrain run with ``PlainBeside`` (in this process)."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "steps.json"
        disttrain_results(flavour, steps, global_batch, extra=(
            f"+callbacks.beside._target_={__name__}.PlainBeside", f"+callbacks.beside.out={out}",
            f"+callbacks.beside.flavour={flavour}", f"+callbacks.beside.steps={steps}",
            f"+callbacks.beside.global_batch={global_batch}"))
        return json.loads(out.read_text())


def summary(times: dict[str, list[float]], warmup: int) -> dict[str, float]:
    """Ratios of the interleaved steps after ``warmup`` (see the module's docstring)."""
    ours = times["disttrain"][warmup:]
    plain = times["plain"][warmup:warmup + len(ours)]
    return {"steps": len(ours),
            "total": sum(plain) / sum(ours),
            "median": statistics.median(plain) / statistics.median(ours),
            "pairs": statistics.median(p / o for p, o in zip(plain, ours, strict=True)),
            "added_us": 1e6 * (sum(ours) - sum(plain)) / len(ours),
            "added_median_us": 1e6 * (statistics.median(ours) - statistics.median(plain)),
            "plain_ms": 1e3 * statistics.median(plain), "disttrain_ms": 1e3 * statistics.median(ours)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavour", default="cnn", help="as overhead.py's: cnn, linear or a GPT flavour")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=20, help="steps left out at the start")
    parser.add_argument("--repeats", type=int, default=3, help="runs, each in a fresh process")
    args = parser.parse_args()
    if args.steps <= args.warmup + 1:
        parser.error(f"--steps={args.steps} is invalid: more than --warmup + 1 ({args.warmup + 1})")
    os.environ["OMP_NUM_THREADS"] = "1"
    runs = [summary(in_fresh_process(interleaved_run, args.flavour, args.steps, args.global_batch), args.warmup)
            for _ in range(args.repeats)]
    print(f"\nCPU: {cpu_model()}; {workload_name(args.flavour)}, global batch {args.global_batch}, {args.steps} steps "
          f"(the first {args.warmup} left out), one process, one thread, torch {torch.__version__}\n")
    print("| run | plain step ms (median) | disttrain step ms (median) | disttrain / plain steps/s (total time) "
          "| of median steps | median of pairs | added per step (total) | added (medians) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for i, run in enumerate(runs, 1):
        print(f"| {i} | {run['plain_ms']:.3f} | {run['disttrain_ms']:.3f} | **{run['total']:.4f}** | "
              f"{run['median']:.4f} | {run['pairs']:.4f} | {run['added_us']:.0f} us | "
              f"{run['added_median_us']:.0f} us |")


if __name__ == "__main__":
    main()
