"""The mixture loader's tokens/s per worker against the tokens/s a GPT-2 124M training step consumes.

Python's documentation dealt into three sources (Parquet, JSON lines, text files; ``disttrain.data.pydocs_sources``)
and a byte-level BPE tokenizer trained on it, mixed with weights 2:1:1 into windows of ``--block-size`` tokens. One
loader worker reads, tokenises and packs the stream; on ``R`` data-parallel ranks every worker still walks the
whole stream (a window's place depends on every document before it) and keeps its rank's share, so the rate it
delivers is measured for 1 and 2 ranks. Against it: the tokens/s of a GPT-2 124M step (AdamW, fp32, batch
``--cpu-batch`` x 1024) measured here on the CPU, and ``--gpu-tokens-per-s`` (a GPT-2 124M step on one GPU,
measured before on an H100-class GPU). Also the packing efficiency: the share of window tokens that are document
tokens (the rest are end-of-document tokens; packing pads nothing).

    python benchmarks/data_throughput.py [--block-size 1024] [--micro 8] [--batches 16] [--cpu-batch 1]
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from machine import cpu_model  # noqa: E402

from disttrain.data import MixtureConfig, MixtureSource  # noqa: E402
from disttrain.data.mixture_stream import MixtureWindows, RankShare, StreamState  # noqa: E402
from disttrain.data.pydocs_sources import write_pydocs_sources  # noqa: E402


def loader_rate(plan, micro: int, batches: int, replicas: int) -> tuple[float, float]:  # noqa: ANN001
    """Tokens/s one worker of rank 0 delivers on ``replicas`` ranks, and the share of its window tokens that are
    document tokens."""
    share = RankShare(micro, 1, replicas, 0, 0, batches)
    windows = MixtureWindows(plan, StreamState.start(len(plan.sources)), share)
    started, tokens, ends = time.perf_counter(), 0, 0
    for inputs, _, _ in windows:
        tokens += inputs.numel()
        ends += int((inputs == plan.eos_id).sum())
    return tokens / (time.perf_counter() - started), 1 - ends / tokens


def gpt2_cpu_rate(batch: int, steps: int = 2) -> float:
    """Tokens/s of a GPT-2 124M training step (forward, backward, AdamW) in fp32 on this CPU."""
    from disttrain.data.spec import DataSpec
    from disttrain.models import build_model
    from disttrain.models.gpt import GPTConfig

    model = build_model(GPTConfig(flavour="gpt2"), DataSpec(kind="text", vocab_size=50304, block_size=1024))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 50257, (batch, 1025))
    times = []
    for _ in range(steps + 1):  # the first step allocates the optimiser's state: not timed
        started = time.perf_counter()
        logits = model(tokens[:, :-1])
        logits = getattr(logits, "logits", logits)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - started)
    return batch * 1024 / float(np.median(times[1:]))


def main() -> None:
    """Measure and print the table and the headline."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--micro", type=int, default=8, help="windows per micro-batch")
    parser.add_argument("--batches", type=int, default=16, help="micro-batches each measurement reads")
    parser.add_argument("--cpu-batch", type=int, default=1, help="sequences of 1024 in the CPU's GPT-2 step")
    parser.add_argument("--gpu-tokens-per-s", type=float, default=450_000.0)
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        paths = write_pydocs_sources(folder)
        cfg = MixtureConfig(sources=[MixtureSource(str(paths["reference"]), 2.0),
                                     MixtureSource(str(paths["library"]), 1.0),
                                     MixtureSource(str(paths["other"] / "*.txt"), 1.0)],
                            tokenizer=str(paths["tokenizer"]), block_size=args.block_size, val_documents=2)
        plan = cfg.plan(seed=0)
        one, packing = loader_rate(plan, args.micro, args.batches, 1)
        two, _ = loader_rate(plan, args.micro, args.batches, 2)
    cpu = gpt2_cpu_rate(args.cpu_batch)
    print(f"{cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads; block {args.block_size}, "
          f"micro-batch {args.micro}, {args.batches} micro-batches per measurement\n")
    print("| what | tokens/s | one worker / it |")
    print("|---|---:|---:|")
    print(f"| loader, one worker, 1 rank | {one:,.0f} | 1.00 |")
    print(f"| loader, one worker of rank 0 of 2 (walks the whole stream) | {two:,.0f} | {one / two:.2f} |")
    print(f"| GPT-2 124M step, fp32, this CPU (batch {args.cpu_batch} x 1024) | {cpu:,.0f} | {one / cpu:.2f} |")
    print(f"| GPT-2 124M step, one GPU (given) | {args.gpu_tokens_per_s:,.0f} | {one / args.gpu_tokens_per_s:.2f} |")
    print(f"\npacking efficiency: {packing:.2%} of window tokens are document tokens (the rest end documents; "
          "no padding)")
    workers = math.ceil(args.gpu_tokens_per_s / one)
    print(f"headline: one loader worker gives {one / args.gpu_tokens_per_s:.3f}x the tokens/s a GPT-2 124M step "
          f"takes on one GPU ({workers} worker(s) per GPU on one rank) and {one / cpu:.1f}x what it takes on this CPU")


if __name__ == "__main__":
    main()
