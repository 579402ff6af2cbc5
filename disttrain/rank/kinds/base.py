"""The interface every kind of run implements, with the behaviour of synchronous data/model parallelism.

A kind decides how updates are exchanged (not how the model is laid out and wrapped: that is the run's
``Layout``): which task runs a training step, what it hands the strategy when it is built (``strategy_hooks``),
which callbacks it adds, and its sections of ``results.json``. The rank's assembly (``disttrain.rank.run``) calls these
and never asks which kind it holds; a kind overrides only what it does differently.
"""

from __future__ import annotations

from typing import Any, ClassVar

import lightning.pytorch as pl
import torch
from torch import nn

from disttrain.config.run import RunConfig
from disttrain.fault.steps import StepAgreement
from disttrain.parallel.strategy import DistTrainStrategy, StrategyHooks
from disttrain.parallel.zero1 import shard_optimizer_state
from disttrain.rank.comm_meter import comm_meter_of
from disttrain.rank.task import TrainTask


class RunKind:
    """One way of training, chosen by validation (``ExecutionPlan.kind``) and built once per rank."""

    name: ClassVar[str] = ""
    """The kind's name in ``ExecutionPlan.kind`` (``disttrain.config.execution.RUN_KINDS``)."""
    gradients_agree: ClassVar[bool] = True
    """After backward every rank holds the same gradients or shards of them (see ``TrainTask``)."""
    task_class: ClassVar[type[TrainTask]] = TrainTask
    """The task ``task`` builds (a kind that steps by hand builds its own)."""

    def __init__(self, run: RunConfig, agreement: StepAgreement) -> None:
        self.run = run
        """The validated run."""
        self.agreement = agreement
        """The ranks' agreement on preemption and non-finite steps, which the task consults."""
        self.comm_meter: Any = None
        """The gradient-exchange meter (set by ``callbacks``)."""

    def steps_per_epoch(self, datamodule: Any) -> int:
        """Optimiser steps in one epoch of ``datamodule``."""
        return datamodule.num_train_samples // self.run.batch.global_size

    def total_steps(self, datamodule: Any) -> int:
        """Optimiser steps of the whole run (sets the length of the learning-rate schedule)."""
        t = self.run.train.trainer
        return t.max_steps if t.max_steps > 0 else max(1, t.max_epochs * self.steps_per_epoch(datamodule))

    def task(self, net: nn.Module, datamodule: Any) -> tuple[pl.LightningModule, Any]:
        """The task whose training step this kind runs, and the data module the Trainer reads."""
        run = self.run
        task = self.task_class(net, datamodule.spec, run.optim, run.scheduler, total_steps=self.total_steps(datamodule),
                               agreement=self.agreement, gradients_agree=self.gradients_agree,
                               compile_mode=run.train.trainer.compiled_mode, loss_mean=run.plan.loss_mean)
        return task, datamodule

    def strategy_hooks(self) -> StrategyHooks:
        """What the strategy is built with for this kind; a synchronous run's: ZeRO-1 wraps the optimiser where
        the layout shards only its state."""
        return StrategyHooks(wrap_optimizer=_zero1 if self.run.layout.shards_only_optimizer_state else None)

    def callbacks(self, strategy: DistTrainStrategy) -> list[pl.Callback]:
        """What the kind adds to the Trainer once the strategy exists: the gradient-exchange meter."""
        self.comm_meter = comm_meter_of(self.run.train.comm, strategy)
        return [self.comm_meter]

    def results(self, trainer: pl.Trainer) -> dict[str, Any]:
        """The kind's sections of ``results.json``, after fit and test."""
        return {"comm": self.comm_meter.result}

    def resume_from(self, trainer: pl.Trainer) -> str | None:
        """A checkpoint the kind itself chooses to fit from, before the run's own choice (None: the run's)."""
        return None

    def writes_results(self, trainer: pl.Trainer) -> bool:
        """Whether this rank writes ``results.json`` and prints the summary."""
        return trainer.is_global_zero

    def close(self) -> None:
        """Release what the kind holds beyond the Trainer (called once the rank is done, also after a failure)."""


def _zero1(optimizer: torch.optim.Optimizer, strategy: DistTrainStrategy) -> torch.optim.Optimizer:
    return shard_optimizer_state(optimizer, strategy.device_mesh["dp_shard"].get_group())
