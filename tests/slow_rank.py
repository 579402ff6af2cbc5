"""A callback that slows one rank on purpose, in its data loading or its backward: a straggler for the tests."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn


class SlowRank(pl.Callback):
    """Sleep ``seconds`` per step on ``rank`` (-1: every rank): between steps, where the next batch is fetched
    (``data``), or inside the backward of the rank's first block (``backward``; under a pipeline, once per
    micro-batch, in the first block of the rank's stage)."""

    def __init__(self, rank: int, phase: str, seconds: float) -> None:
        if phase not in ("data", "backward"):
            raise ValueError(f"SlowRank: phase={phase!r}: data or backward")
        self.rank, self.phase, self.seconds = rank, phase, seconds

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_rank == self.rank and self.phase == "backward":
            # the model's blocks (a ModuleList), or those of the rank's pipeline stage (a ModuleDict of them)
            blocks = next(m for m in pl_module.net.modules()
                          if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m))
            next(iter(blocks.children())).register_forward_hook(self._delay_backward)

    def _delay_backward(self, _module: nn.Module, _inputs: Any, output: Any) -> None:
        # a hook on the block's output gradient: a module's full backward hooks break the split backward (input,
        # then weight gradients) of the zero-bubble schedules
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(lambda _grad: time.sleep(self.seconds))

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        # after the detector's own end of the step (user callbacks come after it): the next batch's fetch
        if self.rank in (trainer.global_rank, -1) and self.phase == "data":
            time.sleep(self.seconds)
