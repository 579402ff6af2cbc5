"""Overhead of disttrain over a hand-written PyTorch loop: same GPT, data, global batch and optimiser.

    python benchmarks/overhead.py [--steps 60] [--flavour nano]
    python benchmarks/overhead.py --flavour cnn --global-batch 64 --steps 320 --repeats 3   # the digits CNN
    python benchmarks/overhead.py --flavour linear --global-batch 64 --steps 2000 --repeats 5   # the loops' own cost
    python benchmarks/overhead.py --device cuda --flavour mini --global-batch 64   # on GPUs (2 ranks: 2+ GPUs)
    python benchmarks/overhead.py --stragglers --flavour nano --steps 300 --repeats 3   # the straggler detector's cost

Runs, in one process tree and one after the other: disttrain single-process, a plain loop
single-process, disttrain DDP on 2 ranks and a plain DDP loop on 2 ranks. The plain loops read each step's
batch out of tensors holding the training set (and, in a second column, through a DataLoader); on 2 ranks
they run torch DDP as it comes (buffers broadcast before every forward) and without that broadcast
(``forward_sync_buffers=False``, which disttrain chooses for models whose only buffers are normalisation
statistics). A last column runs the same step as the smallest LightningModule under Lightning's own Trainer:
what a step inside Lightning's loop costs before any framework adds to it. Each reports optimiser steps per
second measured after the first (warm-up) step, excluding validation. ``--repeats N`` runs every side N
times, alternating; each ratio is taken within a repeat (two runs made one after the other) and reported as the
median over the repeats with its range. Prints a markdown table and, last, the headline ratios and the time
disttrain adds to each step (the difference of the two sides' times per step, paired the same way). The ``linear``
flavour trains one linear layer, whose step computes next to nothing: there the added time is the framework's fixed
cost per step, which divides any workload's ratio as ``step / (step + added)``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fresh_process import in_fresh_process  # noqa: E402
from machine import cpu_model  # noqa: E402
from reference_loops import (  # noqa: E402
    lightning_steps_per_sec,
    plain_steps_per_sec,
    workload_name,
    workload_overrides,
)

SIDES = ("disttrain", "plain", "plain, DataLoader", "plain, no per-step buffer broadcast", "plain Lightning",
         "plain, host memory kept")
"""The loops measured, disttrain first (see the module's docstring)."""


def overrides(flavour: str, steps: int, global_batch: int, devices: int, preset: str = "ddp",
              device: str = "cpu") -> list[str]:
    """The disttrain run being measured: no logging, checkpoints, validation or test. ``flavour``: see
    ``workload_configs``. ``device``: cpu or cuda (a GPU per rank)."""
    return [
        *workload_overrides(flavour), f"batch.global_size={global_batch}", f"trainer.accelerator={device}",
        f"trainer.max_steps={steps}", "trainer.limit_val_batches=0", "trainer.run_test=false",
        "trainer.log_every_n_steps=1000000", "logger=none", "callbacks=none",
        "checkpoint.save_last=false", "checkpoint.save_top_k=0",
        *([f"parallel={preset}", f"trainer.devices={devices}"] if devices > 1 else []),
    ]


def disttrain_steps_per_sec(flavour: str, steps: int, global_batch: int, devices: int, preset: str = "ddp",
                            device: str = "cpu") -> float:
    """Steps/s of ``train()`` as reported in its results.json (clock starts after step 1); one rank runs in a
    fresh process of its own (``in_fresh_process``), as several ranks do."""
    if devices == 1:
        return in_fresh_process(disttrain_in_this_process, flavour, steps, global_batch, device)
    return disttrain_in_this_process(flavour, steps, global_batch, device, devices, preset)


def disttrain_in_this_process(flavour: str, steps: int, global_batch: int, device: str = "cpu", devices: int = 1,
                              preset: str = "ddp", extra: tuple[str, ...] = ()) -> float:
    """Steps/s of ``train()`` started from this process; ``extra``: more overrides of the run."""
    results = disttrain_results(flavour, steps, global_batch, device, devices, preset, extra)
    return results["samples_per_sec"] / global_batch


def disttrain_results(flavour: str, steps: int, global_batch: int, device: str = "cpu", devices: int = 1,
                      preset: str = "ddp", extra: tuple[str, ...] = ()) -> dict:
    """The results.json of ``train()`` started from this process; ``extra``: more overrides of the run."""
    from hydra import compose, initialize_config_dir

    from disttrain.config import register
    from disttrain.launch.job import train

    register()

    with tempfile.TemporaryDirectory() as run_dir:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("train", overrides=[*overrides(flavour, steps, global_batch, devices, preset, device),
                                                     *extra, f"run_dir={run_dir}"])
        train(cfg)
        return json.loads((Path(run_dir) / "results.json").read_text())


def straggler_detector_cost(flavour: str, steps: int, global_batch: int, repeats: int, device: str) -> None:
    """disttrain on 2 ranks (DDP) with the straggler detector on and off (``observe.stragglers``), alternating, at
    the default logging interval (10 steps, so the detector exchanges every 10 steps): a table and the headline
    ratio."""
    extra = ("trainer.log_every_n_steps=10",)
    runs: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(repeats):
        for detector in (False, True):
            runs[detector].append(disttrain_in_this_process(flavour, steps, global_batch, device, 2, "ddp",
                                                            (*extra, f"observe.stragglers={str(detector).lower()}")))
    print(f"\nCPU: {cpu_model()}; {workload_name(flavour)}, global batch {global_batch}, 2 ranks (DDP), {steps} "
          f"steps, logging every 10, {repeats} alternating runs of each side, torch {torch.__version__}\n")
    print("| straggler detector | steps/s (median) |\n|---|---:|")
    for detector in (False, True):
        print(f"| {'on' if detector else 'off'} | {statistics.median(runs[detector]):.2f} |")
    hooks_us, per_gradient_us = detector_hooks_us()
    action_us = pipeline_action_marks_us()
    step_us = 1e6 / statistics.median(runs[False])
    print(f"\nstraggler detector on / off steps/s, paired by repeat: {paired(runs[True], runs[False])}; time it adds "
          f"per step: {added_time(runs[True], runs[False])}. Its hooks alone, timed in one process: {hooks_us:.1f} us "
          f"per step + {per_gradient_us:.2f} us per gradient tensor ({1e2 * hooks_us / step_us:.3f}% of this "
          f"workload's step before the gradients); under a pipeline, {action_us:.2f} us per stage action marked "
          "(a micro-batch's forward, loss or backward)")


def pipeline_action_marks_us(actions: int = 200000) -> float:
    """Microseconds a pipeline stage's action (``disttrain.observe.phases``) costs in marks while the detector
    listens inside a schedule's step: the fastest of 5 timings."""
    import time

    from disttrain.observe.phases import PHASE_MARKS
    from disttrain.observe.stragglers import StragglerDetector

    detector = StragglerDetector(1.2, 2, 10**12, Path(tempfile.gettempdir()))
    PHASE_MARKS.listener = detector._phase_ended
    try:
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            with PHASE_MARKS.schedule_step():
                for _ in range(actions):
                    with PHASE_MARKS.compute("forward"):
                        pass
            best = min(best, time.perf_counter() - started)
    finally:
        PHASE_MARKS.listener = None
    return 1e6 * best / actions


def detector_hooks_us(steps: int = 20000, gradients: int = 100) -> tuple[float, float]:
    """Microseconds the detector's hooks take per step (its clock reads and bookkeeping, the exchange left out),
    and per gradient its backward hook sees; the fastest of 5 timings."""
    import time
    from types import SimpleNamespace

    from disttrain.observe.stragglers import StragglerDetector

    detector = StragglerDetector(1.2, 2, 10**12, Path(tempfile.gettempdir()))  # no window ends: no exchange
    detector.active = detector._timing = True
    trainer = SimpleNamespace(global_step=0)

    def one_step(gradients: int) -> None:
        detector.on_train_batch_start(trainer)
        detector.on_before_backward()
        for _ in range(gradients):
            detector._gradient_accumulated(None)
        detector.on_after_backward()
        trainer.global_step += 1
        detector.on_train_batch_end(trainer)

    timings = {}
    for count in (0, gradients):
        best = float("inf")
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(steps):
                one_step(count)
            best = min(best, time.perf_counter() - started)
        timings[count] = 1e6 * best / steps
    return timings[0], (timings[gradients] - timings[0]) / gradients


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--flavour", default="nano",
                        help="cnn (the digits CNN), linear (one linear layer on the digits) or a GPT flavour on pydocs")
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--repeats", type=int, default=1,
                        help="alternating runs of each side; ratios are the median of the repeats' own")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: a GPU per rank (the 2-rank row needs 2 GPUs)")
    parser.add_argument("--stragglers", action="store_true",
                        help="measure only the straggler detector's cost: disttrain on 2 ranks with it on and off")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("Error: --device cuda: torch sees no GPU here")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    if args.stragglers:
        straggler_detector_cost(args.flavour, args.steps, args.global_batch, args.repeats, args.device)
        return
    on = {"device": args.device}
    rows = []
    for devices in (1, 2) if args.device == "cpu" or torch.cuda.device_count() > 1 else (1,):
        runs: dict[str, list[float]] = {side: [] for side in SIDES}
        for _ in range(args.repeats):  # alternating, so a noisy stretch of the machine hits every side
            runs["disttrain"].append(disttrain_steps_per_sec(args.flavour, args.steps, args.global_batch, devices,
                                                             **on))
            runs["plain"].append(plain_steps_per_sec(args.flavour, args.steps, args.global_batch, devices, **on))
            runs["plain, DataLoader"].append(plain_steps_per_sec(args.flavour, args.steps, args.global_batch,
                                                                 devices, source="loader", **on))
            runs["plain, no per-step buffer broadcast"].append(plain_steps_per_sec(
                args.flavour, args.steps, args.global_batch, devices, wrap="ddp_no_buffer_broadcast", **on)
                if devices > 1 else runs["plain"][-1])
            runs["plain Lightning"].append(lightning_steps_per_sec(args.flavour, args.steps, args.global_batch,
                                                                   devices, **on))
            runs["plain, host memory kept"].append(plain_steps_per_sec(
                args.flavour, args.steps, args.global_batch, devices,
                wrap="ddp" if devices == 1 else "ddp_no_buffer_broadcast", keep_memory=True, **on))
        rows.append((devices, runs))
    workload = workload_name(args.flavour)
    machine = f"GPU: {torch.cuda.get_device_name()}, host CPU: {cpu_model()}" if args.device == "cuda" else \
        f"CPU: {cpu_model()}"
    print(f"\n{machine}; {workload}, global batch {args.global_batch}, {args.steps} steps, "
          f"{args.threads} thread(s) per rank, {args.repeats} alternating runs of each side, "
          f"torch {torch.__version__}\n")
    print("Steps/s: the median of a side's runs. Ratio: disttrain's steps/s over the side's, run by run (each "
          "repeat runs every side once, one after the other), as the median and [lowest, highest] of the "
          "repeats. Plain loops read each step's batch out of in-memory tensors; the DataLoader column reads it "
          "through torch's DataLoader and DistributedSampler. The goals compare with the plain loop that makes no "
          "collective beyond DDP's gradient all-reduce (in one process: the plain loop). Plain Lightning: the "
          "same step as the smallest LightningModule under Lightning's own Trainer, in-memory batches (on 2 "
          "ranks without the buffer broadcast). Host memory kept: that plain loop with glibc's thresholds set as "
          "disttrain's ranks set them (trainer.keep_freed_host_memory). Each one-process run starts in a fresh "
          "process.\n")
    print("| ranks | disttrain steps/s | " + " | ".join(f"{side} | ratio" for side in SIDES[1:]) + " |")
    print("|---|---:|" + "---:|---:|" * (len(SIDES) - 1))
    for devices, runs in rows:
        cells = [f"{statistics.median(runs[side]):.2f} | {paired(runs['disttrain'], runs[side])}"
                 for side in SIDES[1:]]
        print(f"| {devices} | {statistics.median(runs['disttrain']):.2f} | " + " | ".join(cells) + " |")
    goal = "plain, no per-step buffer broadcast"
    print("\ndisttrain / plain PyTorch (in-memory batches, no extra collective) steps/s, median over the repeats: "
          + " and ".join(f"{paired(runs['disttrain'], runs[goal])} on {devices} rank(s)" for devices, runs in rows)
          + " (goals: >= 0.99x in one process, >= 0.97x on 2 ranks); plain Lightning / plain: "
          + " and ".join(paired(runs["plain Lightning"], runs[goal]) for _, runs in rows)
          + "; against the plain loop with host memory kept as disttrain keeps it: "
          + " and ".join(paired(runs["disttrain"], runs["plain, host memory kept"]) for _, runs in rows))
    print("Time disttrain adds per step, over the plain loop and (after the slash) over plain Lightning, median "
          "[lowest, highest] of the repeats: " + " and ".join(
              f"{added_time(runs['disttrain'], runs[goal])} / {added_time(runs['disttrain'], runs['plain Lightning'])}"
              f" on {devices} rank(s)" for devices, runs in rows)
          + "; plain Lightning over the plain loop: "
          + " and ".join(added_time(runs["plain Lightning"], runs[goal]) for _, runs in rows))


def paired(ours: list[float], theirs: list[float]) -> str:
    """``ours[i] / theirs[i]`` over the repeats, each a ratio of two runs made one after the other: the median and,
    in brackets, the lowest and highest. Pairs cancel the machine's slow drifts, which on shared cores moved one
    side's best-of-3 by up to 10% between invocations."""
    ratios = sorted(a / b for a, b in zip(ours, theirs, strict=True))
    return f"{statistics.median(ratios):.3f} [{ratios[0]:.3f}, {ratios[-1]:.3f}]"


def added_time(ours: list[float], theirs: list[float]) -> str:
    """``1 / ours[i] - 1 / theirs[i]`` in microseconds per step (both steps/s) over the repeats, paired as ``paired``
    pairs them: the median and, in brackets, the lowest and highest."""
    added = sorted(1e6 / a - 1e6 / b for a, b in zip(ours, theirs, strict=True))
    return f"{statistics.median(added):.0f} us [{added[0]:.0f}, {added[-1]:.0f}]"


if __name__ == "__main__":
    main()
