"""Router statistics and bias balancing of a mixture-of-experts model, once per optimiser step.

Every mixture layer counts its assignments per expert, its dropped assignments and its balance loss over the
step's training forwards on this rank (``disttrain.models.experts``). Before the optimiser step the counts of all
data-parallel and context-parallel ranks are summed (tensor-parallel ranks count the same tokens; pipeline stages
hold different layers and add theirs into one table), so every rank sees the whole step's load, exactly what one
process training on the whole batch would see: the routing biases move on it alike everywhere, and the logged
statistics equal one process's.
"""

from __future__ import annotations

import re
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn

from disttrain.models.experts import moe_layers
from disttrain.parallel.strategy import DistTrainStrategy


def _layer_index(name: str, position: int) -> int:
    """The block index in a mixture layer's name (``layers.3.feed_forward`` -> 3), else its position."""
    found = re.search(r"(?:^|\.)(\d+)\.", name)
    return int(found.group(1)) if found else position


class ExpertBalance(pl.Callback):
    """Sums the step's router statistics over ranks, moves the routing biases and logs the statistics."""

    def __init__(self, layers: int, experts: int, forwards_per_step: int) -> None:
        self.layers = layers
        """Mixture layers of the whole model (a pipeline stage holds some of them)."""
        self.experts = experts
        """Experts per layer."""
        self.forwards_per_step = forwards_per_step
        """Forward passes per optimiser step on a rank: each balance loss enters backward divided by it, as the
        cross-entropy of each micro-batch does."""
        self.tokens_per_expert = torch.zeros(layers, experts, dtype=torch.float64)
        """Assignments per layer and expert over the run (all ranks)."""
        self.dropped = 0.0
        """Assignments dropped for lack of capacity over the run (all ranks)."""
        self.last: dict[str, float] = {}
        """The statistics of the newest step."""
        self.steps = 0
        """Optimiser steps counted."""
        self.sent_bytes = 0
        """Bytes this rank's expert-parallel exchanges sent to other ranks for training steps (0 without ep)."""
        self._evaluation_bytes = 0
        self._evaluation_start = 0

    @classmethod
    def of(cls, model: nn.Module, forwards_per_step: int) -> ExpertBalance | None:
        """The callback for ``model`` (None: it has no mixture layers)."""
        layers = moe_layers(model)
        return cls(len(layers), layers[0][1].n_experts, forwards_per_step) if layers else None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Each balance loss enters backward with the weight of one forward pass of the step."""
        for _, layer in moe_layers(pl_module.net):
            layer.aux_loss_scale = 1.0 / self.forwards_per_step

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        """Sum the step's statistics over ranks, move the biases, log."""
        layers = moe_layers(pl_module.net)
        self.steps += 1
        self.sent_bytes = self._exchanged(pl_module) - self._evaluation_bytes
        load = torch.zeros(self.layers, self.experts, dtype=torch.float64)
        extra = torch.zeros(self.layers, 3, dtype=torch.float64)  # dropped, balance-loss sum, forwards counted
        for position, (name, layer) in enumerate(layers):
            index = _layer_index(name, position)
            step_load, dropped, aux = layer.take_step_statistics()
            if step_load is not None:
                load[index] = step_load.double().cpu()
                extra[index, 0] = float(dropped)
            if aux is not None:
                extra[index, 1:] = aux.double().cpu()
        table = torch.cat([load, extra], dim=1)
        for group in self._groups(trainer):
            dist.all_reduce(table, group=group)
        load, extra = table[:, :self.experts], table[:, self.experts:]
        for position, (name, layer) in enumerate(layers):
            layer.update_bias(load[_layer_index(name, position)].to(layer.expert_bias.device))
        self.tokens_per_expert += load
        self.dropped += float(extra[:, 0].sum())
        self.last = self._statistics(load, extra)
        if pl_module.logs_this_step():
            for key, value in self.last.items():
                pl_module.log(f"moe/{key}", value, on_step=True, on_epoch=False, sync_dist=False)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Evaluation's exchanges are not a training step's."""
        self._evaluation_start = self._exchanged(pl_module)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """See ``on_validation_start``."""
        self._evaluation_bytes += self._exchanged(pl_module) - self._evaluation_start

    @staticmethod
    def _exchanged(pl_module: pl.LightningModule) -> int:
        """Bytes this rank's expert exchanges have sent so far."""
        exchanges = {layer.experts.expert_parallel for _, layer in moe_layers(pl_module.net)} - {None}
        return sum(exchange.sent_bytes for exchange in exchanges)

    def _groups(self, trainer: pl.Trainer) -> list[dist.ProcessGroup]:
        """The groups whose counts add up: data x context-parallel ranks, then the pipeline stages."""
        strategy = trainer.strategy
        if not isinstance(strategy, DistTrainStrategy):  # one process under a strategy of Lightning's own
            return []
        layout, mesh = strategy.layout, strategy.device_mesh
        groups = [layout.gradient_mesh(mesh).get_group()] if layout.gradient_ranks > 1 else []
        return groups + ([mesh["pp"].get_group()] if layout.pp_enabled else [])

    def _statistics(self, load: torch.Tensor, extra: torch.Tensor) -> dict[str, float]:
        routed = load.sum(1)
        seen = routed > 0
        ratio = (load.max(1).values / (routed / self.experts)).where(seen, torch.ones_like(routed))
        stats = {"load_max_over_mean": float(ratio.max()),
                 "dropped_fraction": float(extra[:, 0].sum() / routed.sum().clamp(min=1))}
        counted = extra[:, 2] > 0
        if counted.any():
            stats["balance_loss"] = float((extra[counted, 1] / extra[counted, 2]).mean())
        mean_load = load.mean(0)
        stats.update({f"tokens_expert_{e}": float(mean_load[e]) for e in range(self.experts)})
        return stats

    @property
    def result(self) -> dict[str, Any]:
        """The ``experts`` section of ``results.json``: assignments per layer and expert over the run, their
        max/mean balance per layer, drops, the bytes this rank's all-to-alls sent per step (forward and backward,
        counted when the step is taken, so a last step's backward is included) and the last step's statistics."""
        totals = self.tokens_per_expert
        mean = totals.mean(1, keepdim=True).clamp(min=1e-12)
        return {
            "tokens_per_expert": totals.tolist(),
            "load_max_over_mean_per_layer": (totals.max(1, keepdim=True).values / mean).squeeze(1).tolist(),
            "dropped_fraction": self.dropped / max(float(totals.sum()), 1.0),
            "all_to_all_bytes_per_step": self.sent_bytes / max(self.steps, 1),
            "last_step": self.last,
        }



class BatchBalanceLoss(pl.Callback):
    """Tells each module that adds a batch-wide balance loss to backward (one with a ``balance_group``: a Hugging
    Face mixture's router loss, ``disttrain.models.hf.balance``) the weight of one forward pass of the step and the
    ranks whose micro-batches make up the step's batch."""

    def __init__(self, forwards_per_step: int) -> None:
        self.forwards_per_step = forwards_per_step
        """Forward passes per optimiser step on a rank: the loss enters backward divided by it, as the cross-entropy
        of each micro-batch does."""

    @classmethod
    def of(cls, model: nn.Module, forwards_per_step: int) -> BatchBalanceLoss | None:
        """The callback for ``model`` (None: nothing in it adds a batch-wide balance loss)."""
        return cls(forwards_per_step) if _batch_losses(model) else None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Set the loss's weight and the ranks it gathers the batch from."""
        group = self._batch_group(trainer)
        for module in _batch_losses(pl_module.net):
            module.aux_loss_scale = 1.0 / self.forwards_per_step
            module.balance_group = group

    @staticmethod
    def _batch_group(trainer: pl.Trainer) -> dist.ProcessGroup | None:
        """The data x context-parallel ranks whose gradients are averaged every step (None: this rank's batch is
        the step's, or replicas exchange updates rather than gradients)."""
        strategy = trainer.strategy
        if not isinstance(strategy, DistTrainStrategy):
            return None
        layout = strategy.layout
        if layout.gradient_ranks == 1 or not layout.ddp_exchange:
            return None
        return layout.gradient_mesh(strategy.device_mesh).get_group()


def _batch_losses(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that add a batch-wide balance loss (they have a ``balance_group`` attribute)."""
    return [module for module in model.modules() if hasattr(module, "balance_group")]
