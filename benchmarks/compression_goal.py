"""Compression that keeps a transformer's loss: GPT nano on pydocs, 2 DDP ranks, 300 steps, seed 1, validation on 20
batches, uncompressed against PowerSGD, ``comm=onebit`` and ``optim=onebit_adam`` at their defaults and any
variants named with ``--variant``.

    python benchmarks/compression_goal.py
    python benchmarks/compression_goal.py --variant "powersgd r32=comm=powersgd comm.rank=32"
    python benchmarks/compression_goal.py --seed 2

Prints the validation loss at the last step with its gap to the uncompressed run, and the bytes each rank sent
relative to an fp32 all-reduce over the whole run (its warm-up included) and after the warm-up. The goal: within 3%
of the uncompressed loss at >= 5x fewer bytes over the run (>= 25x after the warm-up for 1-bit Adam).
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

from communication import CURVE_RUN, CURVE_WORLD, train
from machine import cpu_model

RUN = [*[o for o in CURVE_RUN if not o.startswith("trainer.limit_val_batches")], "trainer.limit_val_batches=20"]
"""The run of the figures: ``benchmarks/communication.py --curves``'s with 20 validation batches."""

DEFAULTS = (("none", ["comm=none"]), ("powersgd (default)", ["comm=powersgd"]), ("onebit (default)", ["comm=onebit"]),
            ("onebit_adam (default)", ["optim=onebit_adam"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=1, help="every run's seed (the goal's figures: 1)")
    parser.add_argument("--variant", action="append", default=[],
                        help="'label=override override ...': one more run beside the defaults")
    args = parser.parse_args()
    runs = [*DEFAULTS, *((label, overrides.split()) for label, overrides in
                         (variant.split("=", 1) for variant in args.variant))]
    overrides = [*RUN, f"seed={args.seed}", f"trainer.max_steps={args.steps}",
                 f"trainer.val_check_interval={args.steps // 3}"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, extra in runs:
            started = time.perf_counter()
            results = train([*overrides, *extra], CURVE_WORLD, Path(tmp) / re.sub(r"\W+", "_", label))
            comm = results["comm"]
            rows.append((label, " ".join(extra), results["metrics"]["val/loss"], comm["compression_ratio"],
                         comm.get("compression_ratio_after_warmup")))
            print(f"  {label}: val/loss {rows[-1][2]:.4f} ({time.perf_counter() - started:.0f} s)", flush=True)
    base = rows[0][2]
    print(f"\nCPU: {cpu_model()}; GPT nano on pydocs, {CURVE_WORLD} DDP ranks (gloo, one thread each), global batch "
          f"64 x 64 tokens, {args.steps} steps, seed {args.seed}, validation loss on 20 batches\n")
    print("| run | overrides | val loss | gap vs none | fp32 bytes / bytes sent, whole run | after the warm-up |")
    print("|---|---|---|---|---|---|")
    for label, extra, loss, whole, after in rows:
        gap = f"{(loss / base - 1) * 100:+.1f}%" if label != "none" else ""
        print(f"| {label} | `{extra}` | {loss:.4f} | {gap} | {whole:.2f}x | {f'{after:.2f}x' if after else ''} |")


if __name__ == "__main__":
    main()
