"""The most any change to the loop around disttrain's task can recover: disttrain's own work per batch with no
Lightning loop around it, beside disttrain and the plain loop.

    python benchmarks/loop_ceiling.py --flavour cnn --steps 320 --repeats 5
    python benchmarks/loop_ceiling.py --flavour linear --steps 2000 --repeats 5

Three sides in one process each (``overhead.py``'s one-process run of the flavour), alternating: the plain loop
(in-memory batches), disttrain as it runs, and disttrain's run with Lightning's training epoch loop replaced by a
bare one. The bare loop reads the trainer's training batches and calls the task's ``training_step``, zeroing and
backward, its clipping hook (the norm and its finiteness check) and ``optimizer_step`` (the loss bookkeeping), the
schedule's step, the progress counts that end the run at ``max_steps`` and the logger connector's calls around a
batch (what ``self.log`` needs); no callback and no other hook runs per batch. It is not a training disttrain
offers: it is where a batch loop of disttrain's own would start from, before calling any callback. Its steps/s is
clocked inside the loop from the end of the first step to the end of the last; the other sides report theirs as
``overhead.py`` does (also from the end of the first step).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fresh_process import in_fresh_process  # noqa: E402
from machine import cpu_model  # noqa: E402
from overhead import added_time, disttrain_in_this_process, disttrain_results, paired  # noqa: E402
from reference_loops import plain_steps_per_sec, workload_name  # noqa: E402

SIDES = ("plain", "disttrain", "bare loop")
"""The loops measured (see the module's docstring)."""


class BareEpoch:
    """Takes the place of ``_TrainingEpochLoop.run``: one epoch of the bare loop; notes when steps end."""

    def __init__(self, before_batch: Any = None) -> None:
        self.step_ends: list[float] = []
        self.before_batch = before_batch
        """Called with the trainer before each batch is read (``interleaved.py --loop bare``), or None."""

    def __call__(self, loop: Any, data_fetcher: Any) -> None:
        """Train on the epoch's batches until the epoch or ``max_steps`` ends."""
        loop.reset()
        loop.on_run_start(data_fetcher)
        trainer = loop.trainer
        task = trainer.lightning_module
        optimizer = trainer.optimizers[0]
        schedules = [config.scheduler for config in trainer.lr_scheduler_configs]
        batches, progress = iter(trainer.train_dataloader), loop.batch_progress
        steps = loop.automatic_optimization.optim_progress.optimizer.step
        logging = trainer._logger_connector
        while not loop.done:
            if self.before_batch is not None:
                self.before_batch(trainer)
            batch = next(batches, None)
            if batch is None:
                break
            progress.increment_ready()
            progress.increment_started()
            logging.on_batch_start(batch)
            batch_idx = progress.current.ready - 1
            task.optimizer_step(trainer.current_epoch, batch_idx, optimizer,
                                functools.partial(self.closure, task, optimizer, batch, batch_idx))
            steps.increment_completed()
            for schedule in schedules:
                schedule.step()
            progress.increment_processed()
            logging.on_batch_end()
            progress.increment_completed()
            self.step_ends.append(time.perf_counter())

    @staticmethod
    def closure(task: Any, optimizer: torch.optim.Optimizer, batch: Any, batch_idx: int) -> torch.Tensor:
        """The task's loss, zeroing, backward and clipping, as the optimiser's closure."""
        with torch.enable_grad():
            task._current_fx_name = "training_step"
            loss = task.training_step(batch, batch_idx)
            optimizer.zero_grad()
            loss.backward()
        task._current_fx_name = "configure_gradient_clipping"
        task.configure_gradient_clipping(optimizer, task.trainer.gradient_clip_val)
        return loss


def bare_loop_steps_per_sec(flavour: str, steps: int, global_batch: int) -> float:
    """Steps/s of disttrain's one-process run with ``BareEpoch`` as its training epoch loop (in a process of its
    own: the loop's class is changed for the whole process)."""
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop

    epoch = BareEpoch()
    _TrainingEpochLoop.run = lambda loop, data_fetcher: epoch(loop, data_fetcher)
    disttrain_results(flavour, steps, global_batch)
    ends = epoch.step_ends
    return (len(ends) - 1) / (ends[-1] - ends[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flavour", default="cnn", help="as overhead.py's: cnn, linear or a GPT flavour")
    parser.add_argument("--steps", type=int, default=320)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    runs: dict[str, list[float]] = {side: [] for side in SIDES}
    measures = {"plain": lambda: plain_steps_per_sec(args.flavour, args.steps, args.global_batch, 1),
                "disttrain": lambda: in_fresh_process(disttrain_in_this_process, args.flavour, args.steps,
                                                      args.global_batch),
                "bare loop": lambda: in_fresh_process(bare_loop_steps_per_sec, args.flavour, args.steps,
                                                      args.global_batch)}
    for _ in range(args.repeats):  # alternating, so a noisy stretch of the machine hits every side
        for side in SIDES:
            runs[side].append(measures[side]())
    print(f"\nCPU: {cpu_model()}; {workload_name(args.flavour)}, global batch {args.global_batch}, {args.steps} steps, "
          f"one process, one thread, {args.repeats} alternating runs of each side, torch {torch.__version__}\n")
    print("| side | steps/s | / plain: median [lowest, highest] | added per step over plain |")
    print("|---|---:|---:|---:|")
    for side in SIDES:
        print(f"| {side} | {statistics.median(runs[side]):.2f} | {paired(runs[side], runs['plain'])} | "
              f"{added_time(runs[side], runs['plain'])} |")
    print(f"\nThe bare loop reaches {paired(runs['bare loop'], runs['plain'])} of the plain loop's steps/s, disttrain "
          f"{paired(runs['disttrain'], runs['plain'])}: Lightning's loop and the callbacks around the task take "
          f"{added_time(runs['disttrain'], runs['bare loop'])} per step.")


if __name__ == "__main__":
    main()
