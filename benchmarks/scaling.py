"""Where data parallelism pays off on this machine: samples/s at 1, 2 and 4 ranks, disttrain and plain torch.

    python benchmarks/scaling.py [--steps 40] [--models cnn,nano,mini] [--presets ddp,zero2,zero3]

For each model (the digits CNN, GPT nano and GPT mini on pydocs) at a small and a large global batch:
one process, then every preset on 2 and 4 ranks (one thread per rank), each beside a plain PyTorch loop of
the same model, data, batch, AdamW, clipping and schedule (torch DDP, or FSDP2 resharding after forward
for zero3 and keeping parameters gathered for zero2). Samples/s after the first step, no validation or
checkpoints. Prints one markdown table: disttrain, plain, their ratio, and the plain loop's speed-up over
one plain process (what data parallelism itself buys here, whatever the framework).
"""

from __future__ import annotations

import argparse
import os

import torch
from machine import cpu_features, cpu_model
from overhead import disttrain_steps_per_sec
from reference_loops import plain_steps_per_sec

BATCHES = {"cnn": (64, 256), "nano": (16, 64), "mini": (16, 64)}
"""Global batches per model: a small and a large one (GPT samples are 64-token windows)."""
PLAIN_WRAP = {"ddp": "ddp", "zero2": "fsdp_keep", "zero3": "fsdp"}


def main() -> None:
    """Measure every row and print the table."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--models", default="cnn,nano,mini")
    parser.add_argument("--presets", default="ddp,zero2,zero3")
    parser.add_argument("--ranks", default="2,4")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # for the workers started below
    torch.set_num_threads(1)  # this process is rank 0 of the disttrain runs: one thread, like every rank
    rows = []
    for model in args.models.split(","):
        for batch in BATCHES[model]:
            layouts = [(1, "single")] + [(int(r), p) for r in args.ranks.split(",") for p in args.presets.split(",")]
            base = None
            for ranks, preset in layouts:
                ours = disttrain_steps_per_sec(model, args.steps, batch, ranks, preset) * batch
                plain = plain_steps_per_sec(model, args.steps, batch, ranks, PLAIN_WRAP.get(preset, "ddp")) * batch
                base = base or plain
                rows.append((model, batch, ranks, preset, ours, plain, plain / base))
                print(rows[-1], flush=True)
    print(f"\nCPU: {cpu_model()} ({cpu_features()}), {os.cpu_count()} cores; one thread per rank; "
          f"{args.steps} steps; torch {torch.__version__}\n")
    print("| model | global batch | ranks | preset | disttrain samples/s | plain samples/s | ratio | "
          "plain vs 1 process |")
    print("|---|---:|---:|---|---:|---:|---:|---:|")
    for model, batch, ranks, preset, ours, plain, speedup in rows:
        print(f"| {model} | {batch} | {ranks} | {preset} | {ours:,.0f} | {plain:,.0f} | {ours / plain:.2f} | "
              f"{speedup:.2f}x |")


if __name__ == "__main__":
    main()
