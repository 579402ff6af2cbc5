"""A callback that turns training into gradient ascent after a given step, so that every later validation is worse
than the one at that step by construction, on any CPU: tests whose premise is "the best checkpoint is not the last"
rest on it instead of on one trajectory."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl


class AscendAfterStep(pl.Callback):
    """Negate every gradient before the optimiser steps, once ``step`` optimiser steps are done: the loss then rises
    at the rate it fell, and validation scores after ``step`` fall far below the one at ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if trainer.global_step >= self.step:
            for parameter in pl_module.parameters():
                if parameter.grad is not None:
                    parameter.grad.neg_()
