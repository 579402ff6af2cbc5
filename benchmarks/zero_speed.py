"""Speed of disttrain ZeRO-3 vs a plain PyTorch FSDP2 script: same GPT, data, batch, optimiser, 2 ranks.

    python benchmarks/zero_speed.py [--steps 100] [--flavour nano]

Both shard per transformer block with FSDP2 and reshard after forward. Prints a markdown table and,
last, the headline ratio (target >= 0.95x).
"""

from __future__ import annotations

import argparse
import os

import torch
from overhead import disttrain_steps_per_sec
from reference_loops import plain_steps_per_sec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--flavour", default="nano")
    parser.add_argument("--global-batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="alternate the two this many times; best of each")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"  # for the workers started below
    torch.set_num_threads(1)  # this process is rank 0 of the disttrain run: one thread, like every rank
    ours, plain = [], []
    for _ in range(args.repeats):  # alternating evens out drift in a shared machine's load
        ours.append(disttrain_steps_per_sec(args.flavour, args.steps, args.global_batch, 2, preset="zero3"))
        plain.append(plain_steps_per_sec(args.flavour, args.steps, args.global_batch, 2, wrap="fsdp"))
    print(f"\nGPT {args.flavour}, pydocs, global batch {args.global_batch}, {args.steps} steps, 2 gloo ranks, "
          f"1 thread each, torch {torch.__version__}\n")
    print("| run | disttrain zero3 steps/s | plain FSDP2 steps/s | ratio |")
    print("|---|---|---|---|")
    for i, (a, b) in enumerate(zip(ours, plain, strict=True)):
        print(f"| {i + 1} | {a:.2f} | {b:.2f} | {a / b:.3f} |")
    print(f"\ndisttrain zero3 / plain FSDP2 steps/s: {max(ours) / max(plain):.3f}x (best of {args.repeats}; "
          "target >= 0.95x)")


if __name__ == "__main__":
    main()
