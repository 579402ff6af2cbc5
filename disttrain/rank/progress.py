"""Progress on the screen: a bar in a terminal, a plain line every few steps elsewhere; both show the training loss
without making the host wait for the GPU on the steps that log nothing."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning_utilities.core.imports import RequirementCache

from disttrain.rank.callbacks import ThroughputMeter

RICH = RequirementCache("rich>=10.2.2")
"""Whether rich is installed at the version Lightning's rich bar needs (Lightning's own test of it)."""

LOSS_KEY = "train/loss"
"""The logged training loss that both displays show."""


class LossShown:
    """Mixin for one of Lightning's progress bars: the training loss read once per logged value.

    The task logs its loss off the progress bar: Lightning converts every progress-bar value to a Python number
    after every batch, a read of the GPU that stalls the host each step. The bar reads the loss here instead,
    when the logged value is a new one.
    """

    _shown: tuple[torch.Tensor, float] | None = None  # the logged tensor and its value as read

    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """Lightning's values, with the loss of the newest logged step."""
        items = super().get_metrics(trainer, pl_module)  # type: ignore[misc]
        loss = trainer.callback_metrics.get(LOSS_KEY)
        if isinstance(loss, torch.Tensor):
            if self._shown is None or self._shown[0] is not loss:
                self._shown = (loss, loss.item())
            items[LOSS_KEY] = f"{self._shown[1]:.4g}"
        return items


class TqdmLossBar(LossShown, TQDMProgressBar):
    """Lightning's tqdm bar, showing the training loss."""


class RichLossBar(LossShown, RichProgressBar):
    """Lightning's rich bar (its default where rich is installed), showing the training loss."""


def loss_bar() -> pl.Callback:
    """The bar Lightning would choose (rich where installed, else tqdm), showing the training loss."""
    return RichLossBar() if RICH else TqdmLossBar()


class PlainProgress(pl.Callback):
    """One log line every ``every`` steps (used instead of a progress bar when output is not a terminal)."""

    def __init__(self, every: int, meter: ThroughputMeter) -> None:
        self.every = max(1, every)
        self.meter = meter

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        step = trainer.global_step
        # step 0: no optimiser step yet (the first micro-batches of an accumulating step)
        if not trainer.is_global_zero or step == 0 or step % self.every or step == getattr(self, "_printed", -1):
            return
        self._printed = step
        metrics = trainer.callback_metrics
        loss = metrics.get(LOSS_KEY)
        total = trainer.max_steps if trainer.max_steps > 0 else trainer.estimated_stepping_batches
        parts = [f"step {step}/{int(total)}", f"epoch {trainer.current_epoch}"]
        if isinstance(loss, torch.Tensor):
            parts.append(f"loss {loss.item():.4f}")
        if trainer.optimizers:
            parts.append(f"lr {trainer.optimizers[0].param_groups[0]['lr']:.3g}")
        rate = self.meter.samples_per_sec
        if rate == rate:  # a text model's rate in tokens, as its results and the field's trainers give it
            parts.append(f"{self.meter.tokens_per_sec:,.0f} tokens/s" if self.meter.tokens_per_sample > 1
                         else f"{rate:.1f} samples/s")
        print(" | ".join(parts), flush=True)

    def on_validation_end(self, trainer: pl.Trainer, *_: Any) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking:
            shown = {k: f"{v.item():.4f}" for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
            print(f"validation at step {trainer.global_step}: {shown}", flush=True)
