"""Activation checkpointing of a model's shard units (its repeated blocks): keep each block's input, recompute
its inside in backward.

Each block gets an instance attribute ``forward`` that runs its class's ``forward`` under non-reentrant
``torch.utils.checkpoint.checkpoint`` (RNG state preserved, so dropout masks are replayed exactly).
No wrapper module is inserted, unlike ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``,
which moves every parameter under ``_checkpoint_wrapped_module.`` (its state-dict hooks hide that from
``state_dict()``, but ``named_parameters()``, param-group names and optimiser state keys still change).
Here the blocks stay the same objects of the same class, a ``ModuleList`` of them stays indexable and every
FQN and state-dict key is unchanged.

Order: apply this before FSDP or DDP. Hooks that FSDP2 registers on a block run around the checkpointed
``forward``, so its parameters are gathered before the recomputation in backward.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from disttrain.parallel.model_plan import shard_units_of


class CheckpointedForward:
    """A block's ``forward`` that recomputes the block's activations in backward."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(type(self.module).forward, self.module, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: nn.Module, units: list[nn.Module] | None = None) -> nn.Module:
    """Checkpoint each of ``units`` (default: the model's shard units) in place; already checkpointed ones
    are left as they are."""
    units = shard_units_of(model) if units is None else units
    if not units:
        raise ValueError(f"{type(model).__name__} has no repeated blocks to checkpoint (declare shard_units())")
    for block in units:
        if not is_checkpointed(block):
            block.forward = CheckpointedForward(block)
    return model


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``apply_activation_checkpointing`` made ``module`` recompute its activations."""
    return isinstance(module.__dict__.get("forward"), CheckpointedForward)
