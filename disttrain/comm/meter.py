"""Bytes each rank sends per optimiser step for the data-parallel gradient exchange, logged and reported."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from torch.nn.parallel import DistributedDataParallel

from disttrain.comm.counter import ByteCounter, ring_allreduce_bytes
from disttrain.comm.exchange import ErrorFeedback
from disttrain.fault.per_rank import PerRankState


class CommMeter(pl.Callback):
    """Measures the gradient bytes per step of a DDP run: counted at disttrain's collective calls for a codec,
    and for ``comm=none`` (DDP's own fp32 all-reduce) the ring all-reduce's bytes of the gradient size."""

    def __init__(self, codec: str, counter: ByteCounter) -> None:
        self.codec, self.counter = codec, counter
        self.fp32_bytes = 0
        """What a ring all-reduce of the fp32 gradients sends per rank and step (the uncompressed reference)."""
        self._start: tuple[int, int] | None = None  # (bytes, global step) when training started
        self.result: dict[str, Any] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Size the uncompressed exchange once the model is wrapped."""
        net = getattr(pl_module, "net", None)
        if not isinstance(net, DistributedDataParallel):
            return
        world = net.process_group.size()
        numel = sum(p.numel() for p in net.parameters() if p.requires_grad)
        self.fp32_bytes = ring_allreduce_bytes(numel, 4, world)
        self._start = (self.counter.bytes_sent, trainer.global_step)

    def bytes_per_step(self, trainer: pl.Trainer) -> float | None:
        """Mean bytes this rank sent per optimiser step so far in this process (None before a step)."""
        if self._start is None or trainer.global_step <= self._start[1]:
            return None
        if self.codec == "none":
            return float(self.fp32_bytes)
        return (self.counter.bytes_sent - self._start[0]) / (trainer.global_step - self._start[1])

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        step = trainer.global_step
        if self._start is not None and step % trainer.log_every_n_steps == 0:
            sent = self.bytes_per_step(trainer)
            if sent is not None:
                pl_module.log("train/comm_bytes_per_step", sent, on_step=True, on_epoch=False)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The figures for ``results.json``."""
        sent = self.bytes_per_step(trainer)
        if sent is None:
            return
        self.result = {"name": self.codec, "bytes_sent_per_step": round(sent),
                       "fp32_allreduce_bytes_per_step": self.fp32_bytes,
                       "compression_ratio": round(self.fp32_bytes / sent, 4) if sent else None,
                       "counted": self.codec != "none"}


class ResidualState(PerRankState):
    """Every rank's error-feedback residuals in the checkpoint, so a resumed run continues the same
    compression (DeepSpeed resets them on load); on another world size the run starts without them."""

    def __init__(self, feedback: ErrorFeedback) -> None:
        self.feedback = feedback

    def own_state(self) -> dict[str, Any]:
        """This rank's residuals."""
        return {key: value.cpu() for key, value in self.feedback.residuals.items()}

    def restore(self, state: dict[str, Any], same_world: bool) -> None:
        """Continue with the checkpoint's residuals (chunk ownership follows the world size)."""
        if same_world:
            self.feedback.residuals = dict(state)
