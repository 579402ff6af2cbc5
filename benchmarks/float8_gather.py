"""Step time of ZeRO-3 with float8 weight gathers, with and without the scales precomputed once per optimiser step.

Under ZeRO-2/3 with ``trainer.fp8=tensorwise`` FSDP2 gathers each float8 layer's weight in float8, scaled by the
amax of the whole weight. Without a precomputed scale every gather takes that amax itself: a reduction and an
all-reduce per weight, in forward and again in backward's re-gather. disttrain's strategy takes them all after
each optimiser step instead (``Float8Layers.after_optimizer_step``: one fused norm and one all-reduce). This script
trains a small GPT on 2 gloo ranks (one thread each), each block and the root ``fully_shard``-ed, with the layers
and the precompute of disttrain's own ``Float8Layers``, and alternates windows of steps with and without the
precompute in the same processes, so both see the same machine load. It prints a table of the windows' median step
times and, last, the headline ratio (without / with: above 1, the precompute is faster).

    python benchmarks/float8_gather.py --layers 4 --width 128 --steps 20 --repeats 5
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
"""The two ways a float8 gather gets its weight's scale, measured in alternating windows."""


def rank_main(rank: int, port: int, args: argparse.Namespace, times: dict[str, list[float]]) -> None:
    """One rank: build, shard and train the GPT, alternating the modes every ``args.steps`` steps; rank 0 puts
    each window's median step time into ``times``."""
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

    def step(precompute: bool) -> float:
        start = time.perf_counter()
        tokens = torch.randint(VOCAB, (args.batch, args.block + 1), generator=generator)
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if precompute:
            layers.after_optimizer_step(model)
        return time.perf_counter() - start

    for _ in range(args.warmup):
        step(True)
    for _ in range(args.repeats):
        for mode in MODES:
            precompute = mode == MODES[0]
            if not precompute:  # no scale of an earlier window's weights may be left for these gathers
                layers.after_weights_replaced(model)
            window = [step(precompute) for _ in range(args.steps)]
            if rank == 0:
                times[mode] = [*times.get(mode, []), statistics.median(window)]
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--width", type=int, default=128, help="model width (a multiple of 16)")
    parser.add_argument("--block", type=int, default=64, help="sequence length")
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    parser.add_argument("--steps", type=int, default=20, help="steps per window")
    parser.add_argument("--repeats", type=int, default=5, help="windows of each mode, alternating")
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
          f"fully_shard-ed), trainer.fp8=tensorwise with float8 gathers; {args.repeats} alternating windows of "
          f"{args.steps} steps\n")
    print("| scales of the float8 gathers | median step (ms) | lowest window | highest window |")
    print("|---|---:|---:|---:|")
    for mode in MODES:
        values = times[mode]
        print(f"| {mode} | {1e3 * statistics.median(values):.1f} | {1e3 * min(values):.1f} | "
              f"{1e3 * max(values):.1f} |")
    ratios = [without / with_ for with_, without in zip(times[MODES[0]], times[MODES[1]], strict=True)]
    print(f"\nfloat8 gathers with the scales precomputed once per step: "
          f"{statistics.median(ratios):.2f}x faster steps than each gather taking its own "
          f"(per window pair [{min(ratios):.2f}, {max(ratios):.2f}])")


if __name__ == "__main__":
    main()
