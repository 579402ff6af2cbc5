"""ZeRO stage 1: parameters and gradients replicated (DDP), optimiser state sharded over the dp ranks.

``shard_optimizer_state`` rebuilds an optimiser as a ``torch.distributed.optim.ZeroRedundancyOptimizer``
of the same class, groups and options. ZeRO gives each rank whole parameters to update (greedily,
largest first, per group), so norms that an optimiser takes per parameter (LAMB's trust ratio, LARS's
local rate) are whole norms without any communication. After its local step each rank broadcasts the
parameters it owns.

Checkpoints: ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` fails on this wrapper
(it calls ``state_dict()``, which needs ``consolidate_state_dict`` first). ``zero1_state_dict`` gathers
the state into the usual ``Optimizer.state_dict`` layout, keyed by the parameter's index in the param
groups, which does not depend on the world size, and ``load_zero1_state_dict`` hands each rank its part
of such a state, on any number of ranks. The runner's checkpoints key the state by parameter name
instead (``zero1_named_state_dict``: the layout of DDP and FSDP checkpoints), so they move between ZeRO
stages and DDP. With ``torch.distributed.checkpoint``::

    dcp.save({"optimizer": zero1_named_state_dict(model, opt, options), ...}, checkpoint_id=path)  # save
    state = {"optimizer": zero1_named_template(model, opt, options), ...}                          # load
    load_sharded(state, path)  # disttrain.checkpoint.io: dcp.load, refusing stored objects that run code
    load_zero1_named_state_dict(model, opt, state["optimizer"], options)
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from disttrain.checkpoint.optimizer_state import FLAT_STATE


class Zero1Optimizer(ZeroRedundancyOptimizer):
    """torch's ``ZeroRedundancyOptimizer`` that says itself what a checkpoint holds of it: the whole state keyed by
    parameter name, as a plain optimiser's (``disttrain.checkpoint.optimizer_state.CheckpointedOptimizer``)."""

    def saved_state(self, model: nn.Module) -> dict[str, Any]:
        """The whole state by parameter name (a collective over the optimiser's group)."""
        return zero1_named_state_dict(model, self, FLAT_STATE)

    def state_template(self, model: nn.Module) -> dict[str, Any]:
        """Tensors of that layout for a load to fill (no collective)."""
        return zero1_named_template(model, self, FLAT_STATE)

    def load_saved_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Keep this rank's part of the loaded whole state."""
        load_zero1_named_state_dict(model, self, state, FLAT_STATE)


def shard_optimizer_state(
    optimizer: torch.optim.Optimizer, process_group: dist.ProcessGroup | None = None
) -> ZeroRedundancyOptimizer:
    """A ZeroRedundancyOptimizer over ``process_group`` that behaves like ``optimizer`` (not yet stepped).

    Every param group is kept with all its keys (``lr``, ``weight_decay``, custom keys such as LAMB/LARS's
    ``adapt``); the constructor gets the optimiser's defaults that it accepts as arguments, plus
    constructor arguments that the optimiser stores as attributes (e.g. ``shard_local_norms``).
    """
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    if optimizer.state:
        raise ValueError("shard_optimizer_state needs an optimiser that has not stepped yet (its state is not empty)")
    groups = [dict(group) for group in optimizer.param_groups]
    return Zero1Optimizer(groups, optimizer_class=type(optimizer), process_group=process_group,
                          **constructor_options(optimizer))


def constructor_options(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The arguments that rebuild ``optimizer``'s class with its options: the defaults its constructor accepts,
    plus constructor arguments it stores as attributes (e.g. ``shard_local_norms``)."""
    cls = type(optimizer)
    accepted = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    for name, param in accepted.items():
        if name not in kwargs and name not in ("self", "params") and hasattr(optimizer, name) \
                and param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY):
            kwargs[name] = getattr(optimizer, name)
    return kwargs


def rebuilt_optimizer(optimizer: torch.optim.Optimizer, keep: Any, replace: Any = None) -> torch.optim.Optimizer:
    """``optimizer``'s class and options over the parameters for which ``keep(param)`` is true (each swapped
    for ``replace(param)`` when given), in its groups (groups left empty are dropped), with all their keys."""
    swap = replace or (lambda p: p)
    groups = [{**group, "params": [swap(p) for p in group["params"] if keep(p)]} for group in optimizer.param_groups]
    return type(optimizer)([g for g in groups if g["params"]], **constructor_options(optimizer))


def zero1_state_dict(optimizer: ZeroRedundancyOptimizer) -> dict[str, Any]:
    """The whole optimiser state on every rank, as ``Optimizer.state_dict()`` lays it out.

    ``state`` maps the index of a parameter in the param groups (counted over all groups, in order) to
    its state on CPU; ``param_groups`` hold the hyper-parameters and those indices. Collective: call it on
    every rank of the optimiser's group. Every rank gets an equal copy, so ``torch.distributed.checkpoint``
    treats it as replicated and writes it once; it costs every rank one full copy of the optimiser
    state in CPU memory while it exists.
    """
    optimizer.consolidate_state_dict(to=0)
    state = [optimizer.state_dict() if optimizer.rank == 0 else None]
    optimizer._all_state_dicts = []  # the gathered copy on rank 0 is not kept
    dist.broadcast_object_list(state, group_src=0, group=optimizer.process_group)
    return state[0]


def zero1_load_template(optimizer: ZeroRedundancyOptimizer) -> dict[str, Any]:
    """``zero1_state_dict`` with every state tensor allocated, for ``dcp.load`` to fill in place.

    A fresh optimiser has no state yet, so (like ``get_optimizer_state_dict`` does for plain optimisers)
    it first takes one step with learning rate 0 on zero gradients, which creates the state and leaves
    the parameters unchanged; the values are overwritten by the load. Collective.
    """
    has_state = torch.tensor([len(optimizer.optim.state)], dtype=torch.int64)
    dist.all_reduce(has_state, group=optimizer.process_group)
    if not has_state.item():
        params = [p for group in optimizer.param_groups for p in group["params"]]
        grads, lrs = [p.grad for p in params], [group["lr"] for group in optimizer.param_groups]
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in optimizer.param_groups:
            group["lr"] = 0.0
        optimizer.step()
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
    return zero1_state_dict(optimizer)


def load_zero1_state_dict(optimizer: ZeroRedundancyOptimizer, state_dict: dict[str, Any]) -> None:
    """Load a state from ``zero1_state_dict`` (saved on any number of ranks); each rank keeps its part.

    ``state_dict`` itself is left unchanged. The param groups must match in number and size.
    """
    groups = state_dict["param_groups"]
    sizes = [len(g["params"]) for g in groups]
    expected = [len(g["params"]) for g in optimizer.param_groups]
    if sizes != expected:
        raise ValueError(f"the state has param groups of sizes {sizes}, the optimiser {expected}")
    optimizer.load_state_dict({"state": dict(state_dict["state"]), "param_groups": copy.deepcopy(groups)})
    optimizer.state.clear()  # the wrapper's own copy is never read (the local optimiser holds the state)


def _unsharded_twin(optimizer: ZeroRedundancyOptimizer) -> torch.optim.Optimizer:
    """A plain optimiser of the same class and groups over all parameters, with no state yet (the wrapper
    keeps the local optimiser's constructor and options, which it needs to build that optimiser itself)."""
    groups = [dict(group) for group in optimizer.param_groups]
    build = optimizer._optim_constructor
    accepted = inspect.signature(build.__init__).parameters
    # a resumed optimiser's defaults hold keys torch's load_state_dict adds (``differentiable``), which an
    # optimiser written here (LAMB, LARS) does not take
    options = {key: value for key, value in optimizer._optim_defaults.items() if key in accepted}
    return build(groups, **options)


def zero1_named_state_dict(model: nn.Module, optimizer: ZeroRedundancyOptimizer, options: Any) -> dict[str, Any]:
    """The whole state of ``optimizer`` keyed by parameter name, exactly as ``get_optimizer_state_dict(model,
    <a plain optimiser>, options)`` lays it out, so a ZeRO-1 checkpoint resumes under any stage or DDP.

    Collective over the optimiser's group; every rank holds a full copy while it exists.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    twin = _unsharded_twin(optimizer)
    twin.load_state_dict(zero1_state_dict(optimizer))
    return get_optimizer_state_dict(model, twin, options=options)


def zero1_named_template(model: nn.Module, optimizer: ZeroRedundancyOptimizer, options: Any) -> dict[str, Any]:
    """A name-keyed state with every tensor allocated, for ``dcp.load`` to fill (no collective)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, _unsharded_twin(optimizer), options=options)


def load_zero1_named_state_dict(model: nn.Module, optimizer: ZeroRedundancyOptimizer, state: dict[str, Any],
                                options: Any) -> None:
    """Load a name-keyed state (from ``zero1_named_state_dict``, DDP or FSDP gathered to whole tensors)."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    twin = _unsharded_twin(optimizer)
    set_optimizer_state_dict(model, twin, state, options=options)
    load_zero1_state_dict(optimizer, twin.state_dict())
