"""1-bit Adam's exchange (Tang et al., 2021): DDP's gradients in fp32 during the warm-up and not at all after
it, when the optimiser sends its momentum instead, as signs and a mean magnitude per block with error feedback
on both phases (the worker's and the server's residual, DeepSpeed's ``worker_error`` and ``server_error``)."""

from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel

from disttrain.comm.codecs import SignCodec
from disttrain.comm.counter import ByteCounter
from disttrain.comm.exchange import compressed_mean
from disttrain.comm.hooks import fp32_mean, register_payload_hook
from disttrain.comm.state import ExchangeState

MOMENTUM_KEY = "momentum"
"""The payload name of the momentum's residuals in ``ExchangeState.feedback`` (kept in the checkpoint)."""


class MomentumExchange:
    """The data-parallel side of 1-bit Adam over ``ddp``'s ranks; bytes go to ``counter``, the step count and
    residuals to ``state`` (the strategy's, which every checkpoint carries per rank)."""

    def __init__(self, ddp: DistributedDataParallel, warmup_steps: int, counter: ByteCounter,
                 state: ExchangeState) -> None:
        self.group = ddp.process_group
        self.warmup_steps = warmup_steps
        """Optimiser steps whose gradients are averaged in fp32 before the momentum is sent compressed."""
        self.counter, self.state = counter, state
        self.codec = SignCodec()
        register_payload_hook(ddp, self._gradients)

    def _gradients(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """DDP's gradients: their fp32 mean during the warm-up, this rank's own after it (nothing is sent)."""
        warming_up = self.state.exchanges < self.warmup_steps
        self.state.exchanges += 1  # once per optimiser step: DDP does not communicate on accumulation micro-batches
        if warming_up:
            return fp32_mean(grads, self.group, self.counter)
        return torch.cat([grad.reshape(-1) for grad in grads])

    def compressing(self) -> bool:
        """Whether this step's gradients stayed local, so the optimiser exchanges its momentum (asked after the
        backward pass, whose exchange counted the step)."""
        return self.state.exchanges > self.warmup_steps

    def mean(self, momentum: torch.Tensor) -> torch.Tensor:
        """The mean over ranks of the flat fp32 ``momentum``, sent as signs and scales with error feedback; every
        rank gets the same values."""
        return compressed_mean(momentum, self.codec, self.group, self.counter, self.state.feedback, MOMENTUM_KEY)

