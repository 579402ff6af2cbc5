"""Overhead of disttrain over a hand-written PyTorch loop: same GPT, data, global batch and optimiser.

    python benchmarks/overhead.py [--steps 60] [--flavour nano]
    python benchmarks/overhead.py --flavour cnn --global-batch 64 --steps 320 --repeats 3   # the digits CNN
    python benchmarks/overhead.py --device cuda --flavour mini --global-batch 64   # on GPUs (2 ranks: 2+ GPUs)

Runs, in one process tree and one after the other: disttrain single-process, a plain loop
single-process, disttrain DDP on 2 ranks and a plain DDP loop on 2 ranks. The plain loops read each step's
batch out of tensors holding the training set (and, in a second column, through a DataLoader); on 2 ranks
they run torch DDP as it comes (buffers broadcast before every forward) and without that broadcast
(``forward_sync_buffers=False``, which disttrain chooses for models whose only buffers are normalisation
statistics). A last column runs the same step as the smallest LightningModule under Lightning's own Trainer:
what a step inside Lightning's loop costs before any framework adds to it. Each reports optimiser steps per
second measured after the first (warm-up) step, excluding validation. Prints a markdown table and, last, the
headline ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fresh_process import in_fresh_process  # noqa: E402
from machine import cpu_model  # noqa: E402
from reference_loops import lightning_steps_per_sec, plain_steps_per_sec  # noqa: E402


def overrides(flavour: str, steps: int, global_batch: int, devices: int, preset: str = "ddp",
              device: str = "cpu") -> list[str]:
    """The disttrain run being measured: no logging, checkpoints, validation or test. ``flavour`` cnn: the
    digits CNN; else a GPT flavour on pydocs. ``device``: cpu or cuda (a GPU per rank)."""
    workload = ["model=cnn", "data=digits"] if flavour == "cnn" else ["model=gpt", f"model.flavour={flavour}",
                                                                      "data=pydocs"]
    return [
        *workload, f"batch.global_size={global_batch}", f"trainer.accelerator={device}",
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
                              preset: str = "ddp") -> float:
    """Steps/s of ``train()`` started from this process."""
    from hydra import compose, initialize_config_dir

    from disttrain.config import register
    from disttrain.launch.job import train

    register()

    with tempfile.TemporaryDirectory() as run_dir:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("train", overrides=[*overrides(flavour, steps, global_batch, devices, preset, device),
                                                     f"run_dir={run_dir}"])
        train(cfg)
        results = json.loads((Path(run_dir) / "results.json").read_text())
    return results["samples_per_sec"] / global_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--flavour", default="nano")
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--repeats", type=int, default=1, help="alternating runs of each side; the best counts")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: a GPU per rank (the 2-rank row needs 2 GPUs)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("Error: --device cuda: torch sees no GPU here")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    torch.set_num_threads(args.threads)
    on = {"device": args.device}
    rows = []
    for devices in (1, 2) if args.device == "cpu" or torch.cuda.device_count() > 1 else (1,):
        ours = plain = loader = quiet = peer = kept = 0.0
        for _ in range(args.repeats):  # alternating, so a noisy stretch of the machine hits both sides
            ours = max(ours, disttrain_steps_per_sec(args.flavour, args.steps, args.global_batch, devices, **on))
            plain = max(plain, plain_steps_per_sec(args.flavour, args.steps, args.global_batch, devices, **on))
            loader = max(loader, plain_steps_per_sec(args.flavour, args.steps, args.global_batch, devices,
                                                     source="loader", **on))
            if devices > 1:
                quiet = max(quiet, plain_steps_per_sec(args.flavour, args.steps, args.global_batch, devices,
                                                       wrap="ddp_no_buffer_broadcast", **on))
            peer = max(peer, lightning_steps_per_sec(args.flavour, args.steps, args.global_batch, devices, **on))
            kept = max(kept, plain_steps_per_sec(args.flavour, args.steps, args.global_batch, devices,
                                                 wrap="ddp" if devices == 1 else "ddp_no_buffer_broadcast",
                                                 keep_memory=True, **on))
        rows.append((devices, ours, plain, loader, quiet or plain, peer, kept))
    workload = "digits CNN" if args.flavour == "cnn" else f"GPT {args.flavour}, pydocs"
    machine = f"GPU: {torch.cuda.get_device_name()}, host CPU: {cpu_model()}" if args.device == "cuda" else \
        f"CPU: {cpu_model()}"
    print(f"\n{machine}; {workload}, global batch {args.global_batch}, {args.steps} steps, "
          f"{args.threads} thread(s) per rank, best of {args.repeats}, torch {torch.__version__}\n")
    print("Plain loops read each step's batch out of in-memory tensors; the DataLoader column reads it through "
          "torch's DataLoader and DistributedSampler. The goals compare with the plain loop that makes no "
          "collective beyond DDP's gradient all-reduce (in one process: the plain loop). Plain Lightning: the "
          "same step as the smallest LightningModule under Lightning's own Trainer, in-memory batches (on 2 "
          "ranks without the buffer broadcast). Host memory kept: the plain loop (no extra collective) with "
          "glibc's thresholds set as disttrain's ranks set them (trainer.keep_freed_host_memory). Each "
          "one-process run starts in a fresh process.\n")
    print("| ranks | disttrain steps/s | plain steps/s | ratio | plain, DataLoader | ratio "
          "| plain, no per-step buffer broadcast | ratio | plain Lightning | ratio | plain Lightning / plain "
          "| plain, host memory kept | ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for devices, ours, plain, loader, quiet, peer, kept in rows:
        print(f"| {devices} | {ours:.2f} | {plain:.2f} | {ours / plain:.3f} | {loader:.2f} | {ours / loader:.3f} "
              f"| {quiet:.2f} | {ours / quiet:.3f} | {peer:.2f} | {ours / peer:.3f} | {peer / quiet:.3f} "
              f"| {kept:.2f} | {ours / kept:.3f} |")
    ratios = [row[1] / row[4] for row in rows]
    peers = [row[5] / row[4] for row in rows]
    kept_ratios = [row[1] / row[6] for row in rows]
    two = f", {ratios[1]:.3f}x on 2 ranks (goal >= 0.97x)" if len(rows) > 1 else ""
    two_peer = f" and {peers[1]:.3f}x" if len(rows) > 1 else ""
    print(f"\ndisttrain / plain PyTorch (in-memory batches, no extra collective) steps/s: {ratios[0]:.3f}x in one "
          f"process (goal >= 0.99x){two}; plain Lightning reaches {peers[0]:.3f}x{two_peer}; against the plain "
          f"loop with host memory kept as disttrain keeps it: {' and '.join(f'{r:.3f}x' for r in kept_ratios)}")


if __name__ == "__main__":
    main()
