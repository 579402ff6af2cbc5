"""Local SGD and DiLoCo: data-parallel replicas train alone and meet every ``parallel.sync_every`` steps.

Each rank runs its own optimiser (the inner one, e.g. AdamW) on its own data without exchanging gradients.
After every ``sync_every`` optimiser steps, and once more at the end of training if the last period was
cut short (so T steps meet ceil(T / H) times), the replicas meet in an outer step: the global parameters
take an SGD step whose gradient is the replicas' mean drift from them, and every replica continues from
the result. With outer lr 1 and no momentum that is the plain average of Local SGD (Stich, 2019; torch's
model averaging does it); with lr 0.7 and Nesterov momentum 0.9 it is DiLoCo (Douillard et al., 2023).
The replicas differ between outer steps, so the strategy checkpoints every rank's own parameters and
optimiser state; the global parameters and the outer momentum are this callback's checkpoint state.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.model_averaging.utils import average_parameters

from disttrain.comm.counter import ByteCounter, ring_allreduce_bytes, ring_allreduce_messages
from disttrain.parallel.config import OuterOptions


def broadcast_module(module: nn.Module, group: dist.ProcessGroup) -> None:
    """Give every rank of ``group`` the parameters and buffers of its first rank (what DDP does when it
    wraps a model): replicas start from one model."""
    source = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=source, group=group)


class OuterSteps(pl.Callback):
    """Runs the outer step every ``sync_every`` optimiser steps and at the end of training."""

    def __init__(self, sync_every: int, outer: OuterOptions, counter: ByteCounter) -> None:
        self.sync_every, self.outer, self.counter = sync_every, outer, counter
        self.syncs = 0
        """Outer steps this process ran."""
        self._net: nn.Module | None = None
        self._group: dist.ProcessGroup | None = None
        self._last_synced = -1
        self._global: list[torch.Tensor] | None = None  # DiLoCo's global parameters
        self._optimizer: torch.optim.SGD | None = None
        self._saved: dict[str, Any] | None = None  # outer state loaded before training started

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start over the data-parallel ranks, from the step training resumes at."""
        self.start(pl_module.net, trainer.strategy.device_mesh["dp_replicate"].get_group(), trainer.global_step)

    def start(self, net: nn.Module, group: dist.ProcessGroup, step: int = 0) -> None:
        """Meet over ``group`` from ``step`` on; DiLoCo keeps global parameters and an outer optimiser."""
        self._net, self._group, self._last_synced = net, group, step
        if self.outer.is_plain_average():
            return
        params = self._params()
        self._global = [param.detach().clone() for param in params]
        self._optimizer = torch.optim.SGD(self._global, lr=self.outer.lr, momentum=self.outer.momentum,
                                          nesterov=self.outer.nesterov)
        if self._saved is not None:
            for mine, saved in zip(self._global, self._saved["global"], strict=True):
                mine.copy_(saved)
            self._optimizer.load_state_dict(self._saved["optimizer"])
            self._saved = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        step = trainer.global_step
        if step != self._last_synced and step % self.sync_every == 0:
            self.outer_step()
            self._last_synced = step

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The replicas meet once more if steps were taken since they last did: training ends on one model."""
        if trainer.global_step != self._last_synced:
            self.outer_step()
            self._last_synced = trainer.global_step

    def outer_step(self) -> None:
        """Meet: average the replicas (Local SGD), or step the global parameters along their mean drift."""
        params = self._params()
        world = dist.get_world_size(self._group)
        self.counter.add(ring_allreduce_bytes(sum(p.numel() for p in params), 4, world), ring_allreduce_messages(world))
        self.syncs += 1
        if self._optimizer is None:
            average_parameters(iter(params), self._group)
            return
        with torch.no_grad():
            drift = torch.cat([(glob - param).reshape(-1) for glob, param in zip(self._global, params, strict=True)])
            drift /= world
            dist.all_reduce(drift, group=self._group)  # one message: the mean drift of the replicas
            offset = 0
            for glob in self._global:
                glob.grad = drift[offset:offset + glob.numel()].view_as(glob)
                offset += glob.numel()
            self._optimizer.step()
            for glob, param in zip(self._global, params, strict=True):
                param.copy_(glob)

    def _params(self) -> list[nn.Parameter]:
        return [param for param in self._net.parameters() if param.requires_grad]

    def state_dict(self) -> dict[str, Any]:
        """DiLoCo's global parameters and outer momentum (the same on every rank)."""
        if self._optimizer is None:
            return {}
        return {"global": [glob.detach().cpu() for glob in self._global], "optimizer": self._optimizer.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Keep the outer state until training starts and the outer optimiser exists."""
        self._saved = state_dict or None
