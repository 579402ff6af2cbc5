"""Learning-rate schedule: linear warm-up, then cosine decay (or a constant rate)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler

from disttrain.errors import ConfigError

SCHEDULES = ("cosine", "constant")


@dataclass
class SchedulerConfig:
    """Per-step learning-rate factor: linear warm-up to the peak, then cosine decay or constant."""

    name: str = "cosine"
    """cosine: decay to min_lr_ratio x peak at the last step; constant: stay at the peak."""
    warmup_steps: int = 0
    """Optimiser steps of linear warm-up."""
    warmup_fraction: float | None = None
    """Warm-up as a fraction of all optimiser steps (instead of warmup_steps); null: use warmup_steps."""
    min_lr_ratio: float = 0.1
    """Final learning rate of the cosine schedule, as a fraction of the peak."""

    def validate(self) -> None:
        """Reject unknown schedules and impossible warm-up lengths or ratios."""
        if self.name not in SCHEDULES:
            raise ConfigError("scheduler.name", self.name, f"one of {list(SCHEDULES)}")
        if self.warmup_steps < 0:
            raise ConfigError("scheduler.warmup_steps", self.warmup_steps, "a number of steps >= 0")
        if self.warmup_fraction is not None:
            if not 0 <= self.warmup_fraction < 1:
                raise ConfigError("scheduler.warmup_fraction", self.warmup_fraction, "a fraction in [0, 1), or null")
            if self.warmup_steps > 0:
                raise ConfigError("scheduler.warmup_fraction", self.warmup_fraction,
                                  "null when scheduler.warmup_steps > 0 (set only one of the two)")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError("scheduler.min_lr_ratio", self.min_lr_ratio, "a fraction in [0, 1]")

    def warmup(self, total_steps: int) -> int:
        """Warm-up length in optimiser steps for a run of ``total_steps``."""
        if self.warmup_fraction is not None:
            return round(self.warmup_fraction * total_steps)
        return self.warmup_steps


def lr_factor(cfg: SchedulerConfig, total_steps: int, step: int) -> float:
    """Factor of the peak learning rate used by optimiser step ``step`` (0-based).

    Warm-up: ``(step + 1) / warmup`` for the first ``warmup`` steps, so the first step already moves and
    step ``warmup - 1`` uses the peak. Cosine: from 1 at step ``warmup`` down to ``min_lr_ratio`` at step
    ``total_steps`` (and after it).
    """
    warmup = cfg.warmup(total_steps)
    if step < warmup:
        return (step + 1) / warmup
    if cfg.name == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(cfg: SchedulerConfig, optimizer: torch.optim.Optimizer, total_steps: int) -> LRScheduler:
    """A per-step ``LambdaLR`` over ``total_steps`` optimiser steps (step it after every optimiser step); ``cfg``
    was validated with the run, only its warm-up against the run's length is checked here."""
    if total_steps < 1:
        raise ValueError(f"total_steps={total_steps} must be >= 1")
    if cfg.warmup(total_steps) > total_steps:
        raise ConfigError("scheduler.warmup_steps", cfg.warmup_steps,
                          f"at most the run's {total_steps} optimiser steps")
    return LambdaLR(optimizer, lambda step: lr_factor(cfg, total_steps, step))


def apply_rate_of_current_step(scheduler: LRScheduler) -> None:
    """Set the optimiser's rates to what ``scheduler`` gives at its current step (``last_epoch``). A restored
    optimiser holds the rate of the schedule it was saved under; a run resumed with another ``max_steps`` has
    another schedule, which would otherwise apply only from the step after the first."""
    if not isinstance(scheduler, LambdaLR):
        return
    for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas,
                                   strict=True):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]  # what get_last_lr() reports
