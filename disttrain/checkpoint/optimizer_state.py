"""What of an optimiser a checkpoint holds, keyed by parameter name under every layout.

Plain optimisers (also over FSDP2's DTensor parameters) go through ``torch.distributed.checkpoint.state_dict``;
a wrapper whose state lies elsewhere (ZeRO-1's shards, a parameter server's) implements ``CheckpointedOptimizer``,
so this module names no layout and no kind of run.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

# Optimiser state keyed by parameter name, hyper-parameters included: pipeline stages hold different
# parameters, and nested param groups of different stages would collide in one checkpoint.
FLAT_STATE = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)


GROUPS_PREFIX = "param_groups."
"""Where a flat optimiser state keeps each parameter's hyper-parameters (``param_groups.<name>.<hyper-parameter>``)."""

PACKED_GROUPS = "packed_param_groups"
"""The checkpoint metadata's mark that its optimiser hyper-parameters are packed (``pack_param_groups``)."""

KERNEL_SWITCHES = ("fused", "foreach", "capturable", "differentiable")
"""Param-group keys that choose how torch's optimisers compute a step, not what they compute."""


@runtime_checkable
class CheckpointedOptimizer(Protocol):
    """An optimiser wrapper that says itself what a checkpoint holds of it and how a load restores it."""

    def saved_state(self, model: nn.Module) -> dict[str, Any]:
        """The state to write (tensors keyed by parameter name)."""
        ...

    def state_template(self, model: nn.Module) -> dict[str, Any]:
        """Tensors of the saved layout for a load to fill in place."""
        ...

    def load_saved_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Take ``state`` (the template, filled) as this optimiser's."""
        ...


def unwrapped(optimizer: Any) -> torch.optim.Optimizer:
    """The optimiser behind Lightning's ``LightningOptimizer`` (itself where it is none)."""
    from lightning.pytorch.core.optimizer import LightningOptimizer

    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s state to save: sharded (DTensor) for FSDP, whole otherwise."""
    optimizer = unwrapped(optimizer)
    if isinstance(optimizer, CheckpointedOptimizer):
        return optimizer.saved_state(model)
    return get_optimizer_state_dict(model, optimizer, options=FLAT_STATE)


def optimizer_template(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What a load of ``optimizer``'s saved state fills."""
    optimizer = unwrapped(optimizer)
    if isinstance(optimizer, CheckpointedOptimizer):
        return optimizer.state_template(model)
    return get_optimizer_state_dict(model, optimizer, options=FLAT_STATE)


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Make the loaded ``state`` (``optimizer_template``'s, filled) ``optimizer``'s own."""
    optimizer = unwrapped(optimizer)
    if isinstance(optimizer, CheckpointedOptimizer):
        optimizer.load_saved_state(model, state)
    else:
        # how the step is computed belongs to this run's layout, not the saving run's: a fused AdamW saved in one
        # process cannot step a mix of plain and tensor-parallel (DTensor) parameters
        kernels = [{key: group[key] for key in KERNEL_SWITCHES if key in group} for group in optimizer.param_groups]
        set_optimizer_state_dict(model, optimizer, state, options=FLAT_STATE)
        for group, switches in zip(optimizer.param_groups, kernels, strict=True):
            group.update(switches)


def pack_param_groups(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` (a flat optimiser state) with each parameter's hyper-parameters in one entry,
    ``param_groups.<name>`` -> ``[[hyper-parameter, value], ...]``.

    torch.distributed.checkpoint writes every non-tensor entry as an item of its own, pickled and planned apart: a
    dozen per parameter for AdamW (240 of the digits CNN's 338 items, and as many loads). Packed, each parameter
    has one, still under its own name (pipeline stages hold different parameters). Tensor-valued
    hyper-parameters (a learning rate kept as a tensor) stay as they are."""
    packed: dict[str, Any] = {}
    groups: dict[str, list[list[Any]]] = {}
    for key, value in state.items():
        if key.startswith(GROUPS_PREFIX) and "." in key[len(GROUPS_PREFIX):] and not torch.is_tensor(value):
            name, hyper = key[len(GROUPS_PREFIX):].rsplit(".", 1)
            groups.setdefault(name, []).append([hyper, value])
        else:
            packed[key] = value
    packed.update({f"{GROUPS_PREFIX}{name}": pairs for name, pairs in groups.items()})
    return packed


def unpack_param_groups(state: dict[str, Any], packed_keys: set[str]) -> dict[str, Any]:
    """``pack_param_groups``'s ``state`` flat again, given the keys it packed."""
    flat = {key: value for key, value in state.items() if key not in packed_keys}
    for key in packed_keys:
        flat.update({f"{key}.{hyper}": value for hyper, value in state[key]})
    return flat
