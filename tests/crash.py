"""A callback that kills its process at a given optimiser step, as a power cut or an OOM killer would."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl


class CrashAtStep(pl.Callback):
    """``os._exit(1)`` on every rank once ``step`` optimiser steps are done: nothing is saved or flushed."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        if trainer.global_step >= self.step:
            os._exit(1)
