"""Bytes each rank sends per optimiser step for the data-parallel gradient exchange, logged and reported."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from disttrain.comm.config import CommConfig
from disttrain.comm.counter import ByteCounter, ring_allreduce_bytes, ring_allreduce_messages, sharded_bytes
from disttrain.parallel.layout import Layout


class CommMeter(pl.Callback):
    """Measures the gradient bytes per step of a data-parallel run. A codec's bytes are counted at disttrain's
    collective calls; DDP's own fp32 all-reduce (``comm=none``) and FSDP2's collectives (ZeRO-2/3) are
    computed from the parameter count as ring collectives, and reported as ``counted: false``. Beside them, the
    bytes a matrix optimiser (Muon, SOAP) gathers per step to step split matrices whole, as it counts them
    (``matrix_gather_bytes_per_step``: this rank's, under any layout that splits its matrices)."""

    def __init__(self, codec: str, counter: ByteCounter, layout: Layout, param_dtype: torch.dtype,
                 reduce_dtype: torch.dtype, warmup_steps: int = 0) -> None:
        self.codec, self.counter = codec, counter
        self.warmup_steps = warmup_steps
        """Optimiser steps sent in fp32 before the compression starts (the bytes after them are reported apart)."""
        self._after_warmup: tuple[int, int] | None = None  # (bytes, global step) when the warm-up was over
        self.layout = layout
        self.itemsizes = (reduce_dtype.itemsize, param_dtype.itemsize)
        self.fp32_bytes = 0
        """What a ring all-reduce of the fp32 gradients sends per rank and step (the uncompressed reference)."""
        self.computed: tuple[int, int] | None = None
        """(bytes, messages) per step from the formula where disttrain does not make the calls (None: counted)."""
        self._start: tuple[int, int, int] | None = None  # (bytes, messages, global step) when training started
        self.gatherer: Any = None
        """The matrix optimiser (Muon, SOAP) that counts the bytes it gathers to step split matrices whole (None:
        the run has none)."""
        self._gathers_start: tuple[int, int] | None = None  # (bytes gathered, global step) when training started
        self.result: dict[str, Any] | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Size the uncompressed exchange once the model is wrapped."""
        net = getattr(pl_module, "net", None)
        optimizer = trainer.optimizers[0] if trainer.optimizers else None
        self.gatherer = next((o for o in (optimizer, getattr(optimizer, "optim", None))  # ZeRO-1's local one
                              if hasattr(o, "gathered_bytes")), None)
        if self.gatherer is not None:
            self._gathers_start = (self.gatherer.gathered_bytes, trainer.global_step)
        if getattr(optimizer, "exchange", None) is not None:  # an optimiser that exchanges over the ranks (1-bit Adam)
            self.codec, self.warmup_steps = optimizer.wire_name, optimizer.warmup_steps
        numel = sum(p.numel() for p in net.parameters() if p.requires_grad) if net is not None else 0
        if isinstance(net, DistributedDataParallel):
            world = net.process_group.size()
            self.fp32_bytes = ring_allreduce_bytes(numel, 4, world)
            if self.codec == "none":
                self.computed = (self.fp32_bytes, ddp_buckets(net, numel * 4) * ring_allreduce_messages(world))
        elif isinstance(net, FSDPModule) and not self.layout.tp_enabled and not self.layout.pp_enabled:
            shard, replicate = self.layout.shard_degree, self.layout.dp_replicate  # FSDP shards over dp_shard x cp
            self.fp32_bytes = ring_allreduce_bytes(numel, 4, self.layout.dp)
            units = sum(isinstance(module, FSDPModule) for module in net.modules())
            # per unit: a reduce-scatter, an all-reduce over the replicas, one all-gather (two for ZeRO-3)
            gathers = self.layout.gathers_per_microbatch
            per_unit = (shard - 1) * gathers + (shard - 1)
            per_unit += ring_allreduce_messages(replicate) if replicate > 1 else 0
            # experts split over ep ranks are sharded over the other shard / ep ranks, at 1/ep of their size
            experts = sum(p.numel() for m in net.modules() if hasattr(m, "expert_parallel")
                          for p in m.parameters(recurse=False) if p.requires_grad)
            ep = self.layout.ep
            sent = sharded_bytes(numel - experts, shard, replicate, *self.itemsizes, gathers)
            if experts:
                sent += sharded_bytes(experts // ep, shard // ep, replicate, *self.itemsizes, gathers)
            self.computed = (sent, units * per_unit)
        elif net is not None and self.layout.dp_enabled and not (isinstance(net, FSDPModule) or self.layout.tp_enabled
                                                               or self.layout.pp_enabled):
            # replicas outside DDP (Local SGD, DiLoCo, a parameter server): their exchanges are counted
            self.fp32_bytes = ring_allreduce_bytes(numel, 4, self.layout.dp)
        else:
            return
        self._start = (self.counter.bytes_sent, self.counter.messages, trainer.global_step)
        self._note_warmup_end(trainer)

    def _note_warmup_end(self, trainer: pl.Trainer) -> None:
        """Remember the counter when the warm-up is over."""
        if self._after_warmup is None and trainer.global_step >= self.warmup_steps:
            self._after_warmup = (self.counter.bytes_sent, trainer.global_step)

    def after_warmup_per_step(self, trainer: pl.Trainer) -> float | None:
        """Mean bytes this rank sent per optimiser step since the warm-up ended (None before a step after it)."""
        if self._after_warmup is None or trainer.global_step <= self._after_warmup[1]:
            return None
        if self.computed is not None:
            return float(self.computed[0])
        return (self.counter.bytes_sent - self._after_warmup[0]) / (trainer.global_step - self._after_warmup[1])

    def per_step(self, trainer: pl.Trainer) -> tuple[float, float] | None:
        """Mean bytes and messages this rank sent per optimiser step so far in this process (None before a
        step)."""
        if self._start is None or trainer.global_step <= self._start[2]:
            return None
        if self.computed is not None:
            return float(self.computed[0]), float(self.computed[1])
        steps = trainer.global_step - self._start[2]
        return (self.counter.bytes_sent - self._start[0]) / steps, (self.counter.messages - self._start[1]) / steps

    def gathered_per_step(self, trainer: pl.Trainer) -> float | None:
        """Mean bytes this rank gathered per optimiser step so far to step its split matrices whole, as the matrix
        optimiser counted them (None: no matrix optimiser, or before a step)."""
        if self._gathers_start is None or trainer.global_step <= self._gathers_start[1]:
            return None
        return (self.gatherer.gathered_bytes - self._gathers_start[0]) / (trainer.global_step - self._gathers_start[1])

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        step = trainer.global_step
        if self._start is not None:
            self._note_warmup_end(trainer)
        if self._start is not None and step % trainer.log_every_n_steps == 0:
            sent = self.per_step(trainer)
            if sent is not None:
                pl_module.log("train/comm_bytes_per_step", sent[0], on_step=True, on_epoch=False)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The figures for ``results.json``."""
        gathered = self.gathered_per_step(trainer)
        if gathered:  # beside the gradient exchange, also where that is not measured (tensor parallelism)
            self.result = {"name": self.codec, "matrix_gather_bytes_per_step": round(gathered)}
        per_step = self.per_step(trainer)
        if per_step is None:
            return
        sent, messages = per_step
        self.result = {"name": self.codec, "bytes_sent_per_step": round(sent),
                       "messages_per_step": round(messages, 3),
                       "fp32_allreduce_bytes_per_step": self.fp32_bytes,
                       "compression_ratio": round(self.fp32_bytes / sent, 4) if sent else None,
                       "counted": self.computed is None}
        if gathered is not None:
            self.result["matrix_gather_bytes_per_step"] = round(gathered)
        after = self.after_warmup_per_step(trainer)
        if self.warmup_steps and after is not None:  # the whole run's figure above includes the fp32 warm-up
            self.result.update(warmup_steps=self.warmup_steps, bytes_sent_per_step_after_warmup=round(after),
                               compression_ratio_after_warmup=round(self.fp32_bytes / after, 4) if after else None)


def ddp_buckets(ddp: DistributedDataParallel, nbytes: int) -> int:
    """About how many buckets DDP all-reduces ``nbytes`` of gradients in: its first bucket holds up to 1 MiB
    (torch's default first cap), the others up to ``bucket_cap_mb`` (bounds fall between tensors)."""
    rest = ddp.bucket_bytes_cap
    first = min(getattr(torch.distributed, "_DEFAULT_FIRST_BUCKET_BYTES", rest), rest)
    return 1 if nbytes <= first else 1 + -(-(nbytes - first) // rest)


def comm_meter_of(config: CommConfig, strategy: Any) -> CommMeter:
    """The meter of a run's gradient exchange under ``strategy`` (a ``DistTrainStrategy``)."""
    from disttrain.comm.hooks import wire_dtype
    from disttrain.parallel.fsdp import mixed_precision_policy

    policy = mixed_precision_policy(strategy.precision, strategy.root_device.type, wire_dtype(config))
    param_dtype = (policy.param_dtype if policy is not None else None) or torch.float32
    reduce_dtype = (policy.reduce_dtype if policy is not None else None) or param_dtype
    return CommMeter(config.name, strategy.comm_counter, strategy.layout, param_dtype, reduce_dtype,
                     config.warmup_steps)
