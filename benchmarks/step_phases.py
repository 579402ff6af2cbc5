"""Where a training step's time goes, by phase, in disttrain and in the plain loop of ``overhead.py``, side by side.

    python benchmarks/step_phases.py [--flavour cnn] [--global-batch 64] [--steps 300] [--ranks 1] [--repeats 3]
    python benchmarks/step_phases.py --device cuda --flavour mini      # on GPUs (a GPU per rank)

Both sides train the same model on the same data with AdamW, clipping at 1.0 and a cosine schedule (the workload
of ``overhead.py``). disttrain's phases are timed by a callback at Lightning's hooks, the plain loop's at the same
boundaries in its code:

- data and loop: from the end of one step to the start of the next step's forward (the plain loop indexes its
  in-memory tensors; disttrain adds Lightning's fetch from its DataLoader, its loop and the batch-start hooks);
- forward: zeroing the gradients, the forward and the loss (disttrain: Lightning's closure around them);
- backward: the backward (under DDP with its gradient all-reduce);
- after backward: from the end of the backward to the optimiser's turn (nothing in the plain loop; Lightning's
  closure and callbacks' ``on_before_optimizer_step``);
- optimiser: clipping, the optimiser and the schedule (disttrain: the task's loss logging and finiteness check,
  Lightning's optimiser and scheduler wrappers and the batch-end hooks).

Each phase is the median over the measured steps of the best of ``--repeats`` alternating runs; the last row
is the whole step. Prints a markdown table. ``--device cuda``: every mark on both sides waits for the GPU first, so
a phase holds the GPU work it queued; the host can then no longer run ahead, and the steps are serialised ones.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from machine import cpu_model  # noqa: E402
from overhead import overrides  # noqa: E402
from reference_loops import PhaseClock, plain_loop, workload_name  # noqa: E402

PHASES = ("data and loop", "forward", "backward", "after backward", "optimiser")


class HookPhases(pl.Callback):
    """Marks a ``PhaseClock`` at the Lightning hooks that bound the plain loop's phases; rank 0 writes the
    medians to ``out`` (JSON) when training ends."""

    def __init__(self, out: str, synchronize: bool = False) -> None:
        self.out = out
        self.clock = PhaseClock(synchronize)

    def on_train_batch_start(self, *_: Any) -> None:
        """The batch is fetched: the step's forward begins."""
        self.clock.mark("step")

    def on_before_backward(self, *_: Any) -> None:
        """The loss exists."""
        self.clock.mark("forward")

    def on_after_backward(self, *_: Any) -> None:
        """The gradients exist (under DDP, all-reduced)."""
        self.clock.mark("backward")

    def on_before_optimizer_step(self, *_: Any) -> None:
        """The optimiser's turn."""
        self.clock.mark("after backward")

    def on_train_batch_end(self, *_: Any) -> None:
        """The step is taken, the schedule advanced."""
        self.clock.mark("optimiser")

    def on_train_end(self, trainer: pl.Trainer, *_: Any) -> None:
        """Write the medians (rank 0)."""
        if trainer.is_global_zero:
            Path(self.out).write_text(json.dumps(self.clock.medians()))


def by_phase(medians: dict[str, float]) -> dict[str, float]:
    """The clock's phases in the table's rows: the time between steps and the data read are one row."""
    rows = {"data and loop": medians.get("between steps", 0.0) + medians.get("data", 0.0)}
    rows.update({name: medians.get(name, 0.0) for name in PHASES[1:]})
    return rows


def disttrain_phases(flavour: str, steps: int, global_batch: int, ranks: int, device: str) -> dict[str, float]:
    """Median milliseconds per phase of ``train()`` on ``ranks`` ranks (``overhead.py``'s run, plus the clock)."""
    from hydra import compose, initialize_config_dir

    from disttrain.config import register
    from disttrain.launch.job import train

    register()
    with tempfile.TemporaryDirectory() as run_dir:
        out = Path(run_dir) / "phases.json"
        with initialize_config_dir(config_dir=str(HERE.parent / "conf"), version_base="1.3"):
            cfg = compose("train", overrides=[*overrides(flavour, steps, global_batch, ranks, device=device),
                                              "plots=false", "+callbacks.phases._target_=step_phases.HookPhases",
                                              f"+callbacks.phases.synchronize={device == 'cuda'}",
                                              f"+callbacks.phases.out={out}", f"run_dir={run_dir}"])
        train(cfg)
        return by_phase(json.loads(out.read_text()))


def plain_phases(flavour: str, steps: int, global_batch: int, ranks: int, device: str) -> dict[str, float]:
    """Median milliseconds per phase of the plain loop (in-memory batches) on ``ranks`` ranks."""
    out: dict = {}
    if ranks == 1:
        plain_loop(0, 1, 0, flavour, steps, global_batch, out, phases=True, device=device)
        return by_phase(out["phases"])
    import torch.multiprocessing as mp

    from disttrain.parallel.process_group import free_port

    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(plain_loop, args=(ranks, free_port(), flavour, steps, global_batch, shared, "ddp_no_buffer_broadcast",
                                   "memory", True, device), nprocs=ranks)
        return by_phase(shared["phases"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavour", default="cnn",
                        help="cnn (the digits CNN), linear (one linear layer on the digits) or a GPT flavour on pydocs")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs of each side; the fastest counts")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: a GPU per rank (NCCL), each mark after the GPU has finished")
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        sys.exit(f"Error: --device cuda --ranks {args.ranks}: torch sees {torch.cuda.device_count()} GPU(s) here, "
                 "one per rank is needed")
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "disttrain": []}
    for _ in range(args.repeats):
        runs["plain"].append(plain_phases(args.flavour, args.steps, args.global_batch, args.ranks, args.device))
        runs["disttrain"].append(disttrain_phases(args.flavour, args.steps, args.global_batch, args.ranks,
                                                  args.device))
    plain, ours = (min(found, key=lambda phases: sum(phases.values())) for found in runs.values())
    workload = workload_name(args.flavour)
    layout = "one process" if args.ranks == 1 else f"{args.ranks} ranks, DDP (no per-step buffer broadcast)"
    where = (f"GPU: {torch.cuda.get_device_name()}, host CPU: {cpu_model()}" if args.device == "cuda" else
             f"CPU: {cpu_model()}")
    print(f"\n{where}; {workload}, global batch {args.global_batch}, {layout}, {args.steps} steps, "
          f"1 thread per rank, fastest of {args.repeats}, torch {torch.__version__}\n")
    print("| phase | plain loop, ms | disttrain, ms | disttrain - plain, ms |")
    print("|---|---:|---:|---:|")
    for name in PHASES:
        print(f"| {name} | {plain[name]:.3f} | {ours[name]:.3f} | {ours[name] - plain[name]:+.3f} |")
    total_plain, total_ours = sum(plain.values()), sum(ours.values())
    print(f"| step | {total_plain:.3f} | {total_ours:.3f} | {total_ours - total_plain:+.3f} |")
    print(f"\nmedian step: disttrain / plain time {total_ours / total_plain:.3f}, steps/s ratio "
          f"{total_plain / total_ours:.3f}")


if __name__ == "__main__":
    main()
