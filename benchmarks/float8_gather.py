"""Step time of ZeRO-3 with float8 weight gathers, with and without the scales precomputed once per optimiser step.

Under ZeRO-2/3 with ``trainer.fp8=tensorwise`` FSDP2 gathers each float8 layer's weight in float8, scaled by the
amax of the whole weight. Without a precomputed scale every gather takes that amax itself: a reduction and an
all-reduce per weight, in forward and again in backward's re-gather. disttrain's strategy takes them all after
each optimiser step instead (``Float8Layers.after_optimizer_step``: one fused norm and one all-reduce). This script
trains a small GPT on 2 gloo ranks (one thread each), each block and the root ``fully_shard``-ed, with the layers
and the precompute of disttrain's own ``Float8Layers``, and alternates steps with and without the
precompute in the same processes, a step of each in turn, so both see the same machine load. It prints a table of
the steps' wall and CPU times and, last, the headline ratio of the wall times' medians (without / with: above 1,
the precompute is faster).

    python benchmarks/float8_gather.py --layers 8 --width 64 --block 32 --batch 2 --pairs 100
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import cpu_model  # noqa: E402

VOCAB = 256
"""Byte-level vocabulary: the head stays small beside the blocks."""
WORLD = 2
"""Ranks of the ZeRO-3 run."""
MODES = ("precomputed once per step", "taken by each gather")
"""The two ways a float8 gather gets its weight's scale, measured in alternating steps."""


def rank_main(rank: int, port: int, args: argparse.Namespace, times: dict[str, list[float]]) -> None:
    """One rank: build, shard and train the GPT, alternating the modes step by step; rank 0 puts each step's wall
    and CPU time into ``times`` under its mode."""
    from torch.distributed.fsdp import fully_shard

    from disttrain.models.gpt import GPT, GPTDims
    from disttrain.parallel.float8 import choose_float8_layers, convert_to_float8

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = GPT(GPTDims(args.layers, args.heads, args.width, args.block, VOCAB), bias=False)
    layers, _ = choose_float8_layers(model, "tensorwise", None, True, shards_parameters=True, precision="32-true")
    convert_to_float8(model, layers)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(rank)

    def step(precompute: bool) -> tuple[float, float]:
        start, start_cpu = time.perf_counter(), time.process_time()
        tokens = torch.randint(VOCAB, (args.batch, args.block + 1), generator=generator)
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if precompute:
            layers.after_optimizer_step(model)
        return time.perf_counter() - start, time.process_time() - start_cpu

    for _ in range(args.warmup):
        step(True)
    for pair in range(args.pairs):
        # one step of each mode per pair, their order swapped every pair: both modes see the same load
        for mode in MODES if pair % 2 == 0 else MODES[::-1]:
            precompute = mode == MODES[0]
            if not precompute:  # no scale taken from earlier weights may be left for this step's gathers
                layers.after_weights_replaced(model)
            elapsed = step(precompute)
            if rank == 0:
                times[mode] = [*times.get(mode, []), elapsed]  # (wall, this process's CPU) seconds
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--width", type=int, default=64, help="model width (a multiple of 16)")
    parser.add_argument("--block", type=int, default=32, help="sequence length")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank and step")
    parser.add_argument("--pairs", type=int, default=100, help="pairs of steps, one of each mode")
    parser.add_argument("--warmup", type=int, default=5, help="steps before the first window")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from disttrain.parallel.process_group import free_port

    with mp.Manager() as manager:
        times = manager.dict()
        mp.spawn(rank_main, args=(free_port(), args, times), nprocs=WORLD, join=True)
        times = dict(times)
    print(f"CPU: {cpu_model()}; torch {torch.__version__}; {WORLD} gloo ranks, one thread each; GPT {args.layers} "
          f"blocks, width {args.width}, batch {args.batch} x {args.block} per rank; ZeRO-3 (each block and the root "
          f"fully_shard-ed), trainer.fp8=tensorwise with float8 gathers; {args.pairs} pairs of steps, one of each "
          f"mode, in alternating order\n")
    print("| scales of the float8 gathers | median step (ms) | quartiles | median CPU time of rank 0 (ms) "
          "| quartiles |")
    print("|---|---:|---:|---:|---:|")
    for mode in MODES:
        wall = statistics.quantiles([w for w, _ in times[mode]], n=4)
        cpu = statistics.quantiles([c for _, c in times[mode]], n=4)
        print(f"| {mode} | {1e3 * wall[1]:.1f} | {1e3 * wall[0]:.1f}-{1e3 * wall[2]:.1f} | {1e3 * cpu[1]:.1f} | "
              f"{1e3 * cpu[0]:.1f}-{1e3 * cpu[2]:.1f} |")
    walls = {mode: [w for w, _ in times[mode]] for mode in MODES}
    quarter = args.pairs // 4
    ratios = [statistics.median(walls[MODES[1]][q * quarter:(q + 1) * quarter])
              / statistics.median(walls[MODES[0]][q * quarter:(q + 1) * quarter]) for q in range(4)]
    ratio = statistics.median(walls[MODES[1]]) / statistics.median(walls[MODES[0]])
    cpu_ratio = statistics.median(c for _, c in times[MODES[1]]) / statistics.median(c for _, c in times[MODES[0]])
    print(f"\nfloat8 gathers with the scales precomputed once per step: {ratio:.2f}x faster steps than each gather "
          f"taking its own (medians; per quarter of the run [{min(ratios):.2f}, {max(ratios):.2f}]; rank 0's CPU "
          f"time {cpu_ratio:.2f}x)")

if __name__ == "__main__":
    main()
