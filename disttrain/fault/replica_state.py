"""What a live replica group sends a restarted one, per rank and without a collective, and how the restarted
group takes it.

torchft calls the sender in a thread of each serving rank while that rank's main thread waits for the step's
quorum, and the ranks of one restarted group may be served by different groups: anything that talks to other
ranks (gathering per-rank states, broadcasting buffers, checkpoint planning) would deadlock, so every piece
is this rank's own. The receiver gets it as a checkpoint that Lightning restores on its usual resume path
(``DistTrainStrategy.load_checkpoint``): loops, scheduler, callbacks, data position; weights and optimiser
state are copied into the already laid out model here.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from disttrain.fault.per_rank import PerRankState

PEER_CHECKPOINT = "<replica group peer>"
"""The ``ckpt_path`` a restarted group fits with: its state comes from a live group, not from a file."""

LOOPS = ("fit_loop", "validate_loop", "test_loop", "predict_loop")
"""The Trainer's loops, whose states a checkpoint's ``loops`` holds by these names."""


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def local_model_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's tensors of ``module``'s parameters and buffers by name (a shard's local part under FSDP2)."""
    return {name: _local(value).detach() for name, value in module.state_dict().items()}


def local_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` with every DTensor replaced by this rank's local part."""
    state = optimizer.state_dict()
    return {"state": {index: {key: _local(value) for key, value in entry.items()}
                      for index, entry in state["state"].items()},
            "param_groups": state["param_groups"]}


def own_callback_states(trainer: pl.Trainer) -> dict[str, Any]:
    """Every callback's checkpoint state, with per-rank states as this rank's alone (no gathering)."""
    states = {}
    for callback in trainer.callbacks:
        state = {"ranks": [callback.own_state()]} if isinstance(callback, PerRankState) else callback.state_dict()
        if state:
            states[callback.state_key] = state
    return states


def peer_state(trainer: pl.Trainer) -> dict[str, Any]:
    """This rank's whole training state, as a checkpoint dictionary a restarted rank can resume from."""
    state: dict[str, Any] = {
        "epoch": trainer.current_epoch,
        "global_step": trainer.global_step,
        "pytorch-lightning_version": pl.__version__,
        "loops": _between_steps({name: getattr(trainer, name).state_dict() for name in LOOPS}),
        "callbacks": own_callback_states(trainer),
        "optimizer_states": [],  # the optimisers travel whole in "peer_optimizers" (see load_peer_state)
        "lr_schedulers": [config.scheduler.state_dict() for config in trainer.lr_scheduler_configs],
        "peer_model": local_model_state(trainer.lightning_module),
        "peer_optimizers": [local_optimizer_state(optimizer) for optimizer in trainer.optimizers],
    }
    datamodule = trainer.datamodule
    if datamodule is not None:
        data_state = datamodule.state_dict()
        if data_state:
            state[datamodule.__class__.__qualname__] = data_state
    return state


def _between_steps(loops: dict[str, Any]) -> dict[str, Any]:
    """The loops' state as a checkpoint saved at the end of the previous batch holds it, which Lightning knows how
    to resume from: the state is read during the first batch of a step, which has started but not finished (as
    it stands, a restore counted it as done and the restored group ran one batch ahead of its peers)."""
    fit = loops["fit_loop"]
    for part in ("total", "current"):
        counts = fit["epoch_loop.batch_progress"][part]
        done = counts["completed"]
        counts.update(ready=done, started=done, processed=done, completed=done - 1)
    # Lightning adds the batch a checkpoint was saved at the end of to this count as it resumes
    fit["epoch_loop.state_dict"]["_batches_that_stepped"] -= 1
    return loops


def load_peer_state(state: dict[str, Any], module: nn.Module, optimizers: list[torch.optim.Optimizer]
                    ) -> dict[str, Any]:
    """Copy a peer's weights and optimiser state into this rank's (already laid out) ``module`` and
    ``optimizers``; returns the rest, which Lightning restores as it would a checkpoint's metadata."""
    state = dict(state)
    weights = state.pop("peer_model")
    with torch.no_grad():
        for name, value in module.state_dict().items():
            _local(value).copy_(weights[name])
    for optimizer, saved in zip(optimizers, state.pop("peer_optimizers"), strict=True):
        optimizer.load_state_dict(_as_parameters(optimizer, saved))
    return state


def _as_parameters(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """A local optimiser state with each per-parameter tensor (not the step count) made a DTensor of the
    parameter's layout again, where the parameter is one."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    state = {}
    for index, entry in saved["state"].items():
        param = params[int(index)]
        if isinstance(param, DTensor):
            entry = {key: DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                             shape=param.shape, stride=param.stride())
                     if isinstance(value, torch.Tensor) and value.shape == param.to_local().shape and value.dim()
                     else value for key, value in entry.items()}
        state[index] = entry
    return {"state": state, "param_groups": saved["param_groups"]}
