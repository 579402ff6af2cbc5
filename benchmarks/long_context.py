"""Long sequences: per-rank activation memory and step time for cp 1/2/4 x checkpointing none/selective/full.

A GPT of small width (``--n-layer`` 2, ``--n-head`` 2, ``--n-embd`` 64, byte vocabulary) takes ``--batch`` 1
sequence per step at each length; cp > 1 runs on that many gloo ranks, one thread each, the model split as a
training run splits it (``apply_context_parallel``, ``apply_activation_checkpointing``). Per rank:

- memory: what forward leaves alive for backward and the peak during backward, above the parameters and their
  gradients, every storage counted from its creation to its release (``disttrain.plan.measure.measured_activations``);
  the most loaded rank's (ranks attend over different key lengths per chunk);
- time: forward and backward of one step, the median of ``--repeats`` after a warm-up, the slowest rank's;
- the planner's prediction of the peak (``disttrain.plan.planner.predicted_activation_bytes``).

Goals: the peak per rank at cp=4 <= 0.3x cp=1 at the same length; selective checkpointing recovers at least half
of full checkpointing's recompute time (step time above none's) at <= 1.5x full's peak; the planner within 15%.

    python benchmarks/long_context.py [--lengths 512 1024 2048 4096 8192] [--cps 1 2 4]
    python benchmarks/long_context.py --lengths 2048 --n-layer 4 --n-head 4 --n-embd 128 --batch 4   # the recipe's
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from disttrain.data.spec import DataSpec  # noqa: E402
from disttrain.models.gpt import GPT, GPTDims  # noqa: E402
from disttrain.parallel.activation_checkpoint import apply_activation_checkpointing  # noqa: E402
from disttrain.parallel.context import SequenceSplit, apply_context_parallel  # noqa: E402
from disttrain.plan.calibrate import cpu_model  # noqa: E402
from disttrain.plan.measure import measured_activations  # noqa: E402
from disttrain.plan.planner import predicted_activation_bytes  # noqa: E402
from tests.dist_utils import run_on_ranks  # noqa: E402

POLICIES = ("none", "selective", "full")
MIB = 2**20


def build(length: int, shape: tuple[int, int, int], policy: str) -> GPT:
    torch.manual_seed(0)
    n_layer, n_head, n_embd = shape
    net = GPT(GPTDims(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=length, vocab_size=256))
    if policy != "none":
        apply_activation_checkpointing(net, policy=policy)
    return net


def step(net: GPT, inputs: torch.Tensor, targets: torch.Tensor) -> None:
    logits = net(inputs)
    F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1)).backward()


def measure_rank(length: int, shape: tuple[int, int, int], batch: int, repeats: int
                 ) -> dict[str, tuple[int, int, float]]:
    """On each rank: ``policy -> (held bytes, peak bytes, step seconds)``."""
    torch.set_num_threads(1)
    size = dist.get_world_size()
    split = SequenceSplit(dist.group.WORLD, dist.get_rank(), size) if size > 1 else None
    torch.manual_seed(1)
    tokens = torch.randint(0, 256, (batch, length + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if split is not None:
        inputs, targets = split.split(inputs), split.split(targets)
    results = {}
    for policy in POLICIES:
        net = build(length, shape, policy)
        if split is not None:
            apply_context_parallel(net, split)

        step(net, inputs, targets)  # warm-up (and gradients allocated, as after a training step)
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            step(net, inputs, targets)
            times.append(time.perf_counter() - start)
        held, peak = measured_activations(net, (inputs, targets))
        results[policy] = (held, peak, statistics.median(times))
    return results


def predicted_peak(length: int, shape: tuple[int, int, int], batch: int, cp: int, policy: str) -> int:
    n_layer, n_head, n_embd = shape
    with torch.device("meta"):
        net = GPT(GPTDims(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=length, vocab_size=256))
    return int(predicted_activation_bytes(net, DataSpec("text", vocab_size=256, block_size=length), batch, cp,
                                          policy).peak)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--cps", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=2)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1, help="sequences per step")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    shape = (args.n_layer, args.n_head, args.n_embd)
    print(f"CPU: {cpu_model()}, torch {torch.__version__}, GPT {args.n_layer} layers x {args.n_head} heads x width "
          f"{args.n_embd}, {args.batch} sequence(s) per step, fp32, gloo ranks of 1 thread\n")
    print("| tokens | cp | checkpointing | held MiB | peak MiB | planner peak MiB | planner / measured | step ms |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    rows: dict[tuple[int, int, str], tuple[int, int, float, int]] = {}
    for length in args.lengths:
        for cp in args.cps:
            ranks = run_on_ranks(measure_rank, cp, length, shape, args.batch, args.repeats, timeout=900)
            for policy in POLICIES:  # the most loaded rank's, as the planner predicts
                held, peak, seconds = (max(rank[policy][i] for rank in ranks) for i in range(3))
                predicted = predicted_peak(length, shape, args.batch, cp, policy)
                rows[length, cp, policy] = (held, peak, seconds, predicted)
                print(f"| {length} | {cp} | {policy} | {held / MIB:.1f} | {peak / MIB:.1f} | {predicted / MIB:.1f} | "
                      f"{predicted / peak:.3f} | {seconds * 1e3:.0f} |", flush=True)

    longest, most = max(args.lengths), max(args.cps)
    print()
    if 1 in args.cps and most > 1:
        for length in args.lengths:
            ratio = rows[length, most, "none"][1] / rows[length, 1, "none"][1]
            print(f"peak per rank at cp={most} / cp=1, {length} tokens, no checkpointing: {ratio:.3f} (goal <= 0.3)")
    for length in args.lengths:
        for cp in args.cps:
            none, selective, full = (rows[length, cp, p] for p in POLICIES)
            full_extra = full[2] - none[2]
            recovered = (full[2] - selective[2]) / full_extra if full_extra > 0 else float("nan")
            print(f"{length} tokens, cp={cp}: selective recovers {recovered:.2f} of full's recompute time "
                  f"(goal >= 0.5) at {selective[1] / full[1]:.2f}x its peak (goal <= 1.5)")
    worst = max(abs(r[3] / r[1] - 1) for r in rows.values())
    ratio = rows[longest, most, "none"][1] / rows[longest, 1, "none"][1] if 1 in args.cps else float("nan")
    print(f"\nheadline: peak activation memory per rank at cp={most} is {ratio:.3f}x cp=1 at {longest} tokens; "
          f"planner within {worst:.1%} of measured over all rows")


if __name__ == "__main__":
    main()
