"""What the direct training step saves: disttrain with ``trainer.direct_step`` true and false, side by side.

    python benchmarks/direct_step.py [--flavour linear] [--global-batch 64] [--steps 2000] [--repeats 6]
    python benchmarks/direct_step.py --flavour cnn --steps 300 --repeats 6
    python benchmarks/direct_step.py --device cuda --flavour mini --steps 300   # on a GPU

``trainer.direct_step=true`` runs each training batch with Lightning's hooks called directly
(``disttrain.rank.direct_step``); false leaves the batch to Lightning's own loop. Everything else is
``overhead.py``'s one-process run of the flavour. The two sides alternate, each run in a fresh process; a callback
notes the start of every training batch, and each run reports the median and 20th percentile of its step periods
(after 20 warm-up steps) and its steps/s. Differences are paired within a repeat (two runs made one after the
other) and given as the median and [lowest, highest] over the repeats: on shared cores a neighbour's burst moves a
run's mean by several percent, its median step much less.
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
from overhead import disttrain_in_this_process  # noqa: E402
from reference_loops import workload_name  # noqa: E402

WARMUP = 20
"""Steps left out of a run's periods."""


class StepPeriods(pl.Callback):
    """Writes the time between the starts of consecutive training batches (seconds, JSON) to ``out``."""

    def __init__(self, out: str) -> None:
        self.out = out
        self.starts: list[float] = []

    def on_train_batch_start(self, *_: Any) -> None:
        """A batch starts."""
        self.starts.append(time.perf_counter())

    def on_train_end(self, *_: Any) -> None:
        """Write the periods."""
        Path(self.out).write_text(json.dumps([b - a for a, b in zip(self.starts[:-1], self.starts[1:], strict=True)]))


def one_run(flavour: str, steps: int, global_batch: int, direct: bool, device: str = "cpu") -> dict[str, float]:
    """One disttrain run in this process: its median and 20th-percentile step period (seconds) and its steps/s.
    On a GPU the host queues steps ahead, so a period is the GPU's step once the queue is full."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "periods.json"
        steps_per_sec = disttrain_in_this_process(flavour, steps, global_batch, device, extra=(
            f"trainer.direct_step={str(direct).lower()}", f"+callbacks.periods._target_={__name__}.StepPeriods",
            f"+callbacks.periods.out={out}"))
        periods = sorted(json.loads(out.read_text())[WARMUP:])
    return {"median": periods[len(periods) // 2], "p20": periods[len(periods) // 5], "steps/s": steps_per_sec}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavour", default="linear", help="as overhead.py's: linear, cnn or a GPT flavour")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("Error: --device cuda: torch sees no GPU here")
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for repeat in range(args.repeats):
        for direct in (False, True) if repeat % 2 == 0 else (True, False):  # either side goes first half the time
            runs[direct].append(in_fresh_process(one_run, args.flavour, args.steps, args.global_batch, direct,
                                                 args.device))
    machine = f"GPU: {torch.cuda.get_device_name()}, host CPU: {cpu_model()}" if args.device == "cuda" else \
        f"CPU: {cpu_model()}"
    print(f"\n{machine}; {workload_name(args.flavour)}, global batch {args.global_batch}, {args.steps} steps, "
          f"one process, one thread, {args.repeats} alternating runs of each side, torch {torch.__version__}\n")
    print("| measure | Lightning's batch loop | direct step | direct - Lightning's, paired: median [lowest, highest] |")
    print("|---|---:|---:|---:|")
    for key, unit, scale in (("median", "us", 1e6), ("p20", "us", 1e6), ("steps/s", "", 1.0)):
        theirs = [run[key] * scale for run in runs[False]]
        ours = [run[key] * scale for run in runs[True]]
        differences = sorted(a - b for a, b in zip(ours, theirs, strict=True))
        name = {"median": "median step", "p20": "20th percentile step", "steps/s": "steps/s"}[key]
        print(f"| {name} | {statistics.median(theirs):.1f} {unit} | {statistics.median(ours):.1f} {unit} | "
              f"{statistics.median(differences):+.1f} {unit} [{differences[0]:+.1f}, {differences[-1]:+.1f}] |")


if __name__ == "__main__":
    main()
