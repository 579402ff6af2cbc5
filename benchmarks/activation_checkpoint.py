"""Activation checkpointing policies on the nano GPT: bytes kept for backward and training step time.

    python benchmarks/activation_checkpoint.py [--seq 256] [--batch 8] [--steps 20] [--threads 2]

The nano GPT (4 blocks, width 128, 4 heads, byte vocabulary), fp32, dropout 0, AdamW, under
``parallel.activation_checkpoint`` none, selective and full (every block) and, with ``--every 2``, the two
checkpointing policies on every second block. Kept: what one forward leaves allocated for backward
(``tests/test_activation_checkpoint.py``'s measure, from torch's profiler). Step: forward, backward and the
optimiser step, median of ``--steps`` after 3 warm-up steps; with ``--repeats`` the policies take turns and
each keeps its fastest median (the cores may be shared).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from machine import cpu_model  # noqa: E402

from disttrain.models.gpt import FLAVOURS, GPT, GPTDims  # noqa: E402
from disttrain.parallel.activation_checkpoint import apply_activation_checkpointing  # noqa: E402
from tests.test_activation_checkpoint import bytes_kept_by_forward  # noqa: E402

VOCAB = 256
"""Byte-level text, as ``data=pydocs``."""


def step_seconds(model: GPT, tokens: torch.Tensor, steps: int) -> float:
    """Median seconds of one forward, backward and AdamW step on ``tokens``."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for step in range(steps + 3):
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step >= 3:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--every", type=int, default=1, help="also the policies on every n-th block (n > 1)")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    nano = FLAVOURS["nano"]
    dims = GPTDims(n_layer=nano["n_layer"], n_head=nano["n_head"], n_embd=nano["n_embd"], block_size=args.seq,
                   vocab_size=VOCAB)
    tokens = torch.randint(0, VOCAB, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    print(f"CPU: {cpu_model()}, {args.threads} threads, torch {torch.__version__}; nano GPT, batch {args.batch} x "
          f"sequence {args.seq}, fp32\n")
    print("| policy | every n blocks | kept for backward (MiB) | vs none | step (ms) | vs none |")
    print("|---|---:|---:|---:|---:|---:|")
    runs = [("none", 1), ("selective", 1), ("full", 1)]
    runs += [("selective", args.every), ("full", args.every)] if args.every > 1 else []
    models, kept, seconds = {}, {}, {}
    for run in runs:
        torch.manual_seed(0)
        models[run] = apply_activation_checkpointing(GPT(dims), policy=run[0], every_n_blocks=run[1])
        kept[run] = bytes_kept_by_forward(models[run], tokens[:, :-1])
    for _ in range(args.repeats):
        for run in runs:
            seconds[run] = min(seconds.get(run, float("inf")), step_seconds(models[run], tokens, args.steps))
    for run in runs:
        print(f"| {run[0]} | {run[1]} | {kept[run] / 2**20:.1f} | {kept[run] / kept[runs[0]]:.2f} | "
              f"{seconds[run] * 1e3:.0f} | {seconds[run] / seconds[runs[0]]:.2f} |")

if __name__ == "__main__":
    main()
