"""Activation checkpointing of ``model.blocks``: keep each block's input, recompute its inside in backward.

Each block gets an instance attribute ``forward`` that runs its class's ``forward`` under non-reentrant
``torch.utils.checkpoint.checkpoint`` (RNG state preserved, so dropout masks are replayed exactly).
No wrapper module is inserted, unlike ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``,
which moves every parameter under ``_checkpoint_wrapped_module.`` (its state-dict hooks hide that from
``state_dict()``, but ``named_parameters()``, param-group names and optimiser state keys still change).
Here the blocks stay the same objects of the same class, ``model.blocks[i]`` stays indexable and every
FQN and state-dict key is unchanged.

Order: apply this before FSDP or DDP. Hooks that FSDP2 registers on a block run around the checkpointed
``forward``, so its parameters are gathered before the recomputation in backward.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint


class CheckpointedForward:
    """A block's ``forward`` that recomputes the block's activations in backward."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(type(self.module).forward, self.module, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Checkpoint every module of ``model.blocks`` in place (again on an already checkpointed model: no-op)."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no `blocks` ModuleList to checkpoint")
    for block in blocks:
        if not is_checkpointed(block):
            block.forward = CheckpointedForward(block)
    return model


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``apply_activation_checkpointing`` made ``module`` recompute its activations."""
    return isinstance(module.__dict__.get("forward"), CheckpointedForward)
