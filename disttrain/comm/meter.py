"""Bytes each rank sends per optimiser step for the data-parallel gradient exchange, logged and reported."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from disttrain.comm.config import CommConfig
from disttrain.comm.counter import ByteCounter, ring_allreduce_bytes, sharded_bytes
from disttrain.parallel.dims import ParallelDims


class CommMeter(pl.Callback):
    """Measures the gradient bytes per step of a data-parallel run. A codec's bytes are counted at disttrain's
    collective calls; DDP's own fp32 all-reduce (``comm=none``) and FSDP2's collectives (ZeRO-2/3) are
    computed from the parameter count as ring collectives, and reported as ``counted: false``."""

    def __init__(self, codec: str, counter: ByteCounter, dims: ParallelDims, zero_stage: int,
                 param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
        self.codec, self.counter = codec, counter
        self.dims, self.zero_stage = dims, zero_stage
        self.itemsizes = (reduce_dtype.itemsize, param_dtype.itemsize)
        self.fp32_bytes = 0
        """What a ring all-reduce of the fp32 gradients sends per rank and step (the uncompressed reference)."""
        self.computed_bytes: int | None = None
        """Bytes per step from the formula where disttrain does not make the calls (None: counted)."""
        self._start: tuple[int, int] | None = None  # (bytes, global step) when training started
        self.result: dict[str, Any] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Size the uncompressed exchange once the model is wrapped."""
        net = getattr(pl_module, "net", None)
        numel = sum(p.numel() for p in net.parameters() if p.requires_grad) if net is not None else 0
        if isinstance(net, DistributedDataParallel):
            world = net.process_group.size()
            self.fp32_bytes = ring_allreduce_bytes(numel, 4, world)
            if self.codec == "none":
                self.computed_bytes = self.fp32_bytes
        elif isinstance(net, FSDPModule) and not self.dims.tp_enabled and not self.dims.pp_enabled:
            self.fp32_bytes = ring_allreduce_bytes(numel, 4, self.dims.dp)
            self.computed_bytes = sharded_bytes(numel, self.dims.dp_shard, self.dims.dp_replicate, *self.itemsizes,
                                                self.zero_stage)
        elif net is not None and self.dims.dp_enabled:  # replicas that meet in outer steps (counted there)
            self.fp32_bytes = ring_allreduce_bytes(numel, 4, self.dims.dp)
        else:
            return
        self._start = (self.counter.bytes_sent, trainer.global_step)

    def bytes_per_step(self, trainer: pl.Trainer) -> float | None:
        """Mean bytes this rank sent per optimiser step so far in this process (None before a step)."""
        if self._start is None or trainer.global_step <= self._start[1]:
            return None
        if self.computed_bytes is not None:
            return float(self.computed_bytes)
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
                       "counted": self.computed_bytes is None}


def comm_meter_of(config: CommConfig, strategy: Any) -> CommMeter:
    """The meter of a run's gradient exchange under ``strategy`` (a ``DistTrainStrategy``)."""
    from disttrain.comm.hooks import wire_dtype
    from disttrain.parallel.fsdp import mixed_precision_policy

    policy = mixed_precision_policy(strategy.precision, strategy.root_device.type, wire_dtype(config))
    param_dtype = (policy.param_dtype if policy is not None else None) or torch.float32
    reduce_dtype = (policy.reduce_dtype if policy is not None else None) or param_dtype
    return CommMeter(config.name, strategy.comm_counter, strategy.dims, strategy.parallel.zero_stage, param_dtype,
                     reduce_dtype)
