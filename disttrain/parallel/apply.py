"""Plain functions that apply parallelism to a model over a mesh, in one fixed order."""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

from disttrain.parallel.config import DDPOptions, ParallelConfig
from disttrain.parallel.dims import ParallelDims


def apply_parallelism(
    model: nn.Module,
    mesh: DeviceMesh,
    dims: ParallelDims,
    parallel: ParallelConfig,
    device: torch.device,
    sync_batchnorm: bool = False,
) -> nn.Module:
    """Apply the plan of ``parallel`` to ``model``; returns the module to train (maybe a wrapper)."""
    if dims.dp_replicate > 1:
        if sync_batchnorm:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model, mesh["dp_replicate"].get_group())
        model = apply_ddp(model, mesh["dp_replicate"], parallel.ddp, device)
    return model


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, options: DDPOptions, device: torch.device) -> nn.Module:
    """Replicate ``model`` over ``dp_mesh`` with torch DDP (bucketed, overlapped gradient all-reduce)."""
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=dp_mesh.get_group(),
        bucket_cap_mb=options.bucket_cap_mb,
        gradient_as_bucket_view=options.gradient_as_bucket_view,
        static_graph=options.static_graph,
        find_unused_parameters=options.find_unused_parameters,
    )


@contextmanager
def backward_sync_disabled(model: nn.Module) -> Generator[None, None, None]:
    """Within this context backward passes accumulate local gradients without communicating."""
    context = model.no_sync() if isinstance(model, DistributedDataParallel) else nullcontext()
    with context:
        yield
