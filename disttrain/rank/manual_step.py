"""The optimiser step of the kinds of run that step by hand (Lightning's manual optimisation): one sequence,
given what differs between them (how the norm is taken, whether the groups commit the step)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from disttrain.fault.stops import SkippedStep
from disttrain.rank.task import TrainTask


class ManualStepTask(TrainTask):
    """``TrainTask`` whose subclass runs each step's micro-batches itself and ends the step with ``take_step``,
    which takes the pieces of the automatic path (``TrainTask``'s norm, checks, row and count) in one sequence."""

    def __init__(self, *args: Any, accumulation: int, clip: float | None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False
        self.accumulation = accumulation
        """Batches per optimiser step."""
        self.clip = clip
        """The global norm the gradients are clipped to (None: not clipped)."""

    def take_step(self, loss: torch.Tensor, across: dist.ProcessGroup | None = None,
                  commit: Callable[[bool], bool] | None = None) -> bool:
        """End a step whose gradients are complete and whose global mean loss is ``loss``: take the gradients'
        norm (over ``across`` too) and clip them, check the loss and the norm for non-finite numbers, log, step or
        skip, zero, schedule. Returns whether the step was applied.

        A non-finite step is skipped: the optimiser steps without gradients, which changes nothing, and the step
        counts, as under automatic optimisation. ``commit`` (torchft's vote, given whether this group's step is
        finite) decides instead: a step it refuses is not taken at all (no row, no schedule) and is tried again
        under the same number."""
        optimizer = self.optimizers()
        norm = self._gradient_norm(optimizer, self.clip, across)
        try:
            self._check_finite("the training loss", loss)
            if norm is not None:
                self._check_finite("the gradient norm", norm)
            finite = True
        except SkippedStep:
            finite = False
        applied = commit(finite) if commit is not None else finite
        if applied or commit is None:
            if self.clip:
                self._log_grad_norm(norm)
            self._log_step_row(loss, optimizer.optimizer)
            if not applied:
                optimizer.zero_grad(set_to_none=True)
            optimizer.step()
            self.lr_schedulers().step()
        self._count_applied_step(applied)
        optimizer.zero_grad(set_to_none=True)
        return applied

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The step's loss was logged and checked in ``take_step``."""
