"""Model-state memory and communication per rank of DDP and ZeRO-1/2/3, measured against the ZeRO paper.

For each strategy and world size (gloo ranks on CPU) a GPT of ~29M parameters takes a warm-up step with
AdamW (fp32), then one measured step. Memory is read from the tensors each rank really holds (DTensor
local shards, this rank's ZeroRedundancyOptimizer state; storages counted once, padding included) after
the forward, after the backward and after the optimiser step; the peak of params + grads + optimiser
state over those points is compared with the paper's fp32 AdamW formula (P parameters, N ranks):

    ddp 16P    zero1 4P + 4P + 8P/N    zero2 4P + 12P/N    zero3 16P/N

Communication: the torch.distributed collectives are wrapped during the measured step and each call is
charged its ring-model bytes sent per rank: all-reduce 2(N-1)/N x size, reduce-scatter, all-gather and
broadcast (N-1)/N x size (the full-size buffer). DDP's C++ reducer all-reduces outside Python, so DDP
runs with the stock ``allreduce_hook``, which does the same through ``dist.all_reduce``. The paper's
volumes: DDP, ZeRO-1 and ZeRO-2 2(N-1)/N x 4P, ZeRO-3 1.5x that.

    python benchmarks/zero_memory.py [--world-sizes 1 2 4] [--n-layer 8] [--n-embd 512] [--vocab 8192]
"""

from __future__ import annotations

import argparse
import inspect
import os
import resource
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from disttrain.models.gpt import GPT, GPTDims  # noqa: E402
from disttrain.optim import param_groups  # noqa: E402
from disttrain.parallel.fsdp import apply_fsdp  # noqa: E402
from disttrain.parallel.zero1 import shard_optimizer_state  # noqa: E402
from tests.dist_utils import run_on_ranks  # noqa: E402

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
MIB = 2**20

# collective -> (argument holding the full-size buffer, ring-model bytes sent per rank / buffer bytes)
COLLECTIVES = {
    "all_reduce": ("tensor", lambda n: 2 * (n - 1) / n),
    "broadcast": ("tensor", lambda n: (n - 1) / n),
    "all_gather_single": ("output_tensor", lambda n: (n - 1) / n),
    "all_gather_into_tensor": ("output_tensor", lambda n: (n - 1) / n),
    "_all_gather_base": ("output_tensor", lambda n: (n - 1) / n),
    "all_gather": ("tensor_list", lambda n: (n - 1) / n),
    "reduce_scatter_single": ("input", lambda n: (n - 1) / n),
    "reduce_scatter_tensor": ("input", lambda n: (n - 1) / n),
    "_reduce_scatter_base": ("input", lambda n: (n - 1) / n),
    "reduce_scatter": ("input_list", lambda n: (n - 1) / n),
}


class CommCounter:
    """Wraps the collectives of ``torch.distributed`` (and of ``distributed_c10d``, for the deprecated
    aliases that call the new names there) while active; nested calls are charged once, to the outermost."""

    def __init__(self) -> None:
        self.bytes, self.calls, self._depth = 0.0, Counter(), threading.local()

    def _wrap(self, name: str, fn, arg: str, factor):
        signature = inspect.signature(fn)

        def counted(*args, **kwargs):
            depth = getattr(self._depth, "n", 0)
            if depth == 0:
                bound = signature.bind(*args, **kwargs).arguments
                buf = bound[arg]
                size = sum(t.numel() * t.element_size() for t in buf) if isinstance(buf, list) \
                    else buf.numel() * buf.element_size()
                self.bytes += factor(dist.get_world_size(bound.get("group"))) * size
                self.calls[name] += 1
            self._depth.n = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth.n = depth

        return counted

    def __enter__(self) -> CommCounter:
        self._saved = []
        for name, (arg, factor) in COLLECTIVES.items():
            fn = getattr(c10d, name)
            wrapped = self._wrap(name, fn, arg, factor)
            for module in (dist, c10d):
                if getattr(module, name, None) is fn:
                    self._saved.append((module, name, fn))
                    setattr(module, name, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for module, name, fn in self._saved:
            setattr(module, name, fn)


def held_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local shards)."""
    storages = {}
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def peak_rss() -> int:
    """This process's peak resident set size in bytes (``ru_maxrss`` is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(strategy: str, dims: GPTDims, batch: int, seq: int) -> dict:
    """One rank: build, warm up, then measure one step of ``strategy``."""
    world, rss_start = dist.get_world_size(), peak_rss()
    torch.manual_seed(0)
    model = GPT(dims)
    n_params = sum(p.numel() for p in model.parameters())
    if strategy in ("ddp", "zero1"):
        net = DistributedDataParallel(model, gradient_as_bucket_view=True)  # grads are the buckets
        net.register_comm_hook(None, allreduce_hook)
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
        net = apply_fsdp(model, mesh, reshard_after_forward=strategy == "zero3")
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-4)
    if strategy == "zero1":
        opt = shard_optimizer_state(opt)
    shards = held_bytes(p for p in model.parameters() if isinstance(p, DTensor))  # FSDP keeps them throughout
    local_opt = opt.optim if strategy == "zero1" else opt
    gen = torch.Generator().manual_seed(dist.get_rank())

    def points() -> list[dict]:
        x = torch.randint(0, dims.vocab_size, (batch, seq + 1), generator=gen)
        opt.zero_grad(set_to_none=True)
        seen = []

        def snapshot() -> None:
            gathered = held_bytes(p for p in model.parameters() if not isinstance(p, DTensor))
            seen.append({"params": shards + gathered, "grads": held_bytes(p.grad for p in model.parameters()),
                         "optim": held_bytes(v for s in local_opt.state.values() for v in s.values()
                                             if isinstance(v, torch.Tensor))})

        logits = net(x[:, :-1])
        snapshot()
        nn.functional.cross_entropy(logits.reshape(-1, dims.vocab_size), x[:, 1:].reshape(-1)).backward()
        del logits
        snapshot()
        opt.step()
        snapshot()
        return seen

    points()  # warm-up: optimiser state, FSDP lazy init, DDP buckets
    dist.barrier()
    start = time.perf_counter()
    with CommCounter() as counter:
        seen = points()
    return {"P": n_params, "seen": seen, "comm": counter.bytes, "calls": dict(counter.calls),
            "rss": peak_rss(), "rss_start": rss_start, "seconds": time.perf_counter() - start}


def formula(strategy: str, p: int, n: int) -> float:
    """Bytes of fp32 AdamW model state per rank (ZeRO paper, Section 5, with 4-byte params and grads)."""
    return {"ddp": 16 * p, "zero1": 8 * p + 8 * p / n, "zero2": 4 * p + 12 * p / n, "zero3": 16 * p / n}[strategy]


def paper_comm(strategy: str, p: int, n: int) -> float:
    """Bytes sent per rank per step in the ring model: 2(N-1)/N x 4P, 1.5x that for ZeRO-3."""
    return (1.5 if strategy == "zero3" else 1.0) * 2 * (n - 1) / n * 4 * p


def summarise(strategy: str, n: int, ranks: list[dict]) -> tuple[str, float, float | None]:
    """One table row of the most loaded rank (largest peak of params + grads + optimiser state)."""
    p = ranks[0]["P"]
    peaks = [max(sum(point.values()) for point in r["seen"]) for r in ranks]
    worst = ranks[peaks.index(max(peaks))]
    params = max(point["params"] for point in worst["seen"])
    grads, optim = worst["seen"][1]["grads"], worst["seen"][2]["optim"]
    expected, comm_model = formula(strategy, p, n), paper_comm(strategy, p, n)
    sent = max(r["comm"] for r in ranks)
    comm_ratio = sent / comm_model if comm_model else None
    rss, growth = max(r["rss"] for r in ranks), max(r["rss"] - r["rss_start"] for r in ranks)
    calls = ", ".join(f"{k} x{v}" for k, v in sorted(ranks[0]["calls"].items())) or "-"
    ratio = max(peaks) / expected
    row = (f"| {strategy} | {n} | {params / MIB:.1f} | {grads / MIB:.1f} | {optim / MIB:.1f} | {max(peaks) / MIB:.1f} "
           f"| {expected / MIB:.1f} | {ratio:.2f} | {rss / MIB:.0f} (+{growth / MIB:.0f}) | {sent / MIB:.1f} "
           f"| {comm_model / MIB:.1f} | {'-' if comm_ratio is None else f'{comm_ratio:.2f}'} | {calls} |")
    return row, ratio, comm_ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES)
    parser.add_argument("--n-layer", type=int, default=8)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-head", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    args = parser.parse_args()
    dims = GPTDims(args.n_layer, args.n_head, args.n_embd, args.seq, args.vocab)
    # Tensors of 128 KiB and more get their own mmap and go back to the OS when freed, so the ranks'
    # peak RSS follows the memory in use rather than glibc's heap high-water mark.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    started, headline = time.perf_counter(), ""
    print("| strategy | N | params MiB | grads MiB | optim MiB | peak state MiB | formula MiB | ratio "
          "| peak RSS MiB (+ in step) | sent/step MiB | ring model MiB | ratio | collectives per step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for strategy in args.strategies:
        for n in args.world_sizes:
            ranks = run_on_ranks(measure, n, strategy, dims, args.batch, args.seq, timeout=300)
            row, ratio, comm_ratio = summarise(strategy, n, ranks)
            print(row, flush=True)
            comm_text = "" if comm_ratio is None else f", bytes sent / ring model: {comm_ratio:.2f}x"
            headline = f"{strategy} model state / formula: {ratio:.2f}x on {n} ranks{comm_text}"
    print(f"\nGPT {args.n_layer}x{args.n_embd}, vocab {args.vocab}: P = {ranks[0]['P'] / 1e6:.2f}M parameters "
          f"(LM head tied), {args.batch}x{args.seq} tokens per rank, fp32 AdamW, gloo on CPU; "
          f"{time.perf_counter() - started:.0f} s in all. params: largest over the step (FSDP shards plus "
          "parameters gathered at that moment); grads after backward; optim after the step; peak state: "
          "largest sum over after-forward / after-backward / after-step; RSS: peak of the rank, "
          "(+ growth from building the model to the end of the measured step).\n")
    print(headline)


if __name__ == "__main__":
    main()
