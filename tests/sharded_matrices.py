"""A matrix optimiser on two gloo ranks against one process: a small model whose matrices FSDP2 splits unevenly (one
rank's shard of the tall matrix is empty) or tensor parallelism splits by rows and by columns, trained a few steps;
and the optimiser's deliberately per-shard variant, which the comparison must catch. Run inside ``run_on_ranks``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

LAYOUTS = ("fsdp", "tp", "fsdp/shard_local", "tp/shard_local")
"""The splits compared; ``/shard_local`` builds the optimiser with ``shard_local=True``."""


def small_model() -> nn.Module:
    """Uneven shards on 2 ranks (7 and 1 rows), a wide and a tall matrix."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.LayerNorm(10), nn.Tanh(), nn.Linear(10, 7), nn.Tanh(),
                         nn.Linear(7, 1), nn.Flatten(0))


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    """``steps`` optimiser steps on seeded random regression batches."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 6, generator=gen), torch.randn(16, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def layouts_against_one_process(make_optimizer: Callable[..., torch.optim.Optimizer], steps: int,
                                after_fsdp: Callable[[nn.Module, torch.optim.Optimizer], dict[str, Any]]
                                ) -> dict[str, dict[str, Any]]:
    """Per layout of ``LAYOUTS``: the largest difference of the trained weights from one process's and how many
    parameters were sharded; ``after_fsdp(model, optimiser)`` adds its own checks of the FSDP2 run's state."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    reference = small_model()
    train(reference, make_optimizer(reference), steps)
    results = {}
    for layout in LAYOUTS:
        model = small_model()
        if layout.startswith("fsdp"):
            for i in (0, 3, 5):
                fully_shard(model[i], mesh=mesh)
            fully_shard(model, mesh=mesh)
        else:  # tensor-parallel splits: rows of the first matrix, columns of the second
            parallelize_module(model, mesh, {"0": ColwiseParallel(output_layouts=Replicate()),
                                             "3": RowwiseParallel(input_layouts=Replicate())})
        opt = make_optimizer(model, shard_local=layout.endswith("shard_local"))
        train(model, opt, steps)
        diff = max(((p.full_tensor() if isinstance(p, DTensor) else p) - q).abs().max().item()
                   for p, q in zip(model.parameters(), reference.parameters(), strict=True))
        results[layout] = {"max_diff": diff, "sharded": sum(isinstance(p, DTensor) for p in model.parameters())}
        if layout == "fsdp":
            results[layout].update(after_fsdp(model, opt))
    return results
