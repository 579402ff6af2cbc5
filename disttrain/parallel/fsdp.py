"""ZeRO stages 2 and 3 and hybrid sharding (HSDP) with FSDP2 (``torch.distributed.fsdp.fully_shard``).

Stage 2 (``reshard_after_forward=False``): parameters stay gathered from forward until the end of backward,
so backward needs no second all-gather. Stage 3 (``reshard_after_forward=True``): every unit frees its
gathered parameters after its forward and gathers them again in backward (1.5x the communication of
DDP). FSDP2 always frees them after backward, so between steps both stages hold only shards of the
parameters, gradients and optimiser state.

The units of sharding are the model's shard units (``disttrain.parallel.model_plan.shard_units_of``: its
``shard_units()``, by default its repeated blocks), and last the root, which takes all remaining
parameters, e.g. GPT's embeddings, final norm and the LM head, whose weight is tied to the token
embedding: both names refer to one parameter of the root unit, so it is gathered once and its gradient is
the sum of both uses.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from disttrain.parallel.model_plan import shard_units_of


def apply_fsdp(
    model: nn.Module,
    dp_mesh: DeviceMesh,
    *,
    reshard_after_forward: bool,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    units: list[nn.Module] | None = None,
    experts: list[nn.Module] | None = None,
    expert_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """Shard ``model`` in place over ``dp_mesh`` and return it (now also an ``FSDPModule``).

    ``dp_mesh`` is 1-D (``mesh["dp_shard"]``: ZeRO-2/3 over all of it) or 2-D (``mesh["dp_replicate",
    "dp_shard"]``: HSDP, replicated over dim 0 and sharded over dim 1); a 2-D mesh whose dim 0 has size 1
    is reduced to its dim 1. ``mp_policy``: see ``mixed_precision_policy``; None keeps fp32.
    ``offload_policy``: e.g. ``CPUOffloadPolicy()`` to keep shards, gradients and optimiser steps on the
    CPU of a GPU run; None keeps them on the device. ``units``: submodules that become FSDP units of their
    own before the root (default ``shard_units_of(model)``). Build the optimiser afterwards, on the sharded
    parameters (DTensors).
    """
    dp_mesh = _one_dim_if_unreplicated(dp_mesh)
    if dp_mesh.ndim not in (1, 2):
        raise ValueError(f"apply_fsdp needs a 1-D or 2-D data-parallel mesh, got {dp_mesh.ndim}-D")
    kwargs = dict(mesh=dp_mesh, reshard_after_forward=reshard_after_forward,
                  mp_policy=mp_policy or MixedPrecisionPolicy(), offload_policy=offload_policy or OffloadPolicy())
    for unit in experts or []:
        fully_shard(unit, **{**kwargs, "mesh": _one_dim_if_unreplicated(expert_mesh)})
    for unit in shard_units_of(model) if units is None else units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _one_dim_if_unreplicated(mesh: DeviceMesh) -> DeviceMesh:
    """A 2-D (replicate, shard) mesh whose replicate dimension has size 1 as its 1-D shard dimension."""
    if mesh.ndim == 2 and mesh.size(0) == 1 and mesh.mesh_dim_names:
        return mesh[mesh.mesh_dim_names[1]]
    return mesh


def mixed_precision_policy(precision: str, device_type: str, reduce_dtype: torch.dtype | None = None
                           ) -> MixedPrecisionPolicy | None:
    """FSDP2 policy for Lightning's ``precision`` and the gradients' wire dtype ``reduce_dtype`` (``comm``).

    ``"bf16-mixed"`` on CUDA gathers parameters in bf16 and reduces gradients in ``reduce_dtype`` (fp32 by
    default), keeping fp32 shards for the optimiser. Other precisions, including any on CPU, keep parameters
    fp32 and leave mixed precision to autocast. None: the default policy (everything fp32).
    """
    if precision == "bf16-mixed" and device_type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype or torch.float32)
    if reduce_dtype is not None:
        return MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
    return None


def set_gradient_sync(model: nn.Module, enabled: bool, sharded: bool = False) -> None:
    """Turn gradient communication on or off, for gradient accumulation.

    DDP (``no_sync``'s flag) and FSDP2 modules (``set_requires_gradient_sync``; with it off they accumulate
    whole gradients, so ZeRO-2/3 hold full-size gradients until the syncing micro-batch). ``sharded``: FSDP2
    keeps reduce-scattering each backward into the gradient shards and only hybrid sharding's all-reduce
    across replicas waits for the syncing micro-batch (``set_requires_all_reduce``). The last micro-batch of
    an accumulation window must run with ``enabled=True``.
    """
    if isinstance(model, DistributedDataParallel):
        model.require_backward_grad_sync = enabled
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            if sharded:
                module.set_requires_all_reduce(enabled, recurse=False)
            else:
                module.set_requires_gradient_sync(enabled, recurse=False)
