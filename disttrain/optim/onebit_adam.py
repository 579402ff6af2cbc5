"""1-bit Adam (Tang et al., 2021; DeepSpeed's ``OneBitAdam``): AdamW on fp32-averaged gradients for a warm-up,
then the second moment frozen and only the momentum exchanged, as one bit a value with error feedback.

Sign compression of the gradient itself fights Adam's per-value normalisation (``comm=onebit``); once the
variance is frozen the update is linear in the momentum, so the error-feedback residuals of its compression
cancel over steps as they do for SGD.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from disttrain.errors import ConfigError, Refusal
from disttrain.optim.groups import kernel_options, param_groups
from disttrain.optim.registry import OPTIMIZERS
from disttrain.optim.torch_optims import AdamWConfig

DEFAULT_WARMUP_STEPS = 40
"""Steps of plain AdamW before the variance freezes. 1-bit Adam's bytes over a run of S steps are about
(W + (S - W) / 28) / S of fp32's, so a warm-up of W <= S / 6 keeps them >= 5x fewer (W = 40 at S = 300: 6.1x).
On GPT nano (pydocs, 2 ranks, 300 steps) it ended 2.7% (seed 1) and 5.0% (seed 2) above AdamW's validation loss
(benchmarks/README.md)."""


@dataclass
class OneBitAdamConfig(AdamWConfig):
    """1-bit Adam: AdamW's options (its update during ``warmup_steps``), then frozen variance and the momentum sent
    as signs and one mean magnitude per 256 values with error feedback (``parallel=ddp`` with ``comm=none``)."""

    name: str = "onebit_adam"
    """Registry name."""
    warmup_steps: int = DEFAULT_WARMUP_STEPS
    """Optimiser steps of AdamW on fp32-averaged gradients (DeepSpeed's ``freeze_step``); the second moment is
    frozen after them and the momentum exchanged compressed. Absolute steps, counted with the exchange (in the
    checkpoint), so a resumed run switches at the same step."""

    def validate(self) -> None:
        """AdamW's ranges, and a warm-up of at least one step."""
        super().validate()
        if self.warmup_steps < 1:
            raise ConfigError("optim.warmup_steps", self.warmup_steps,
                              "a number of optimiser steps >= 1 (the frozen variance is the warm-up's)")

    def layout_refusal(self, layout: Any) -> Refusal | None:
        """How 1-bit Adam refuses ``layout`` (a ``disttrain.parallel.layout.Layout``), or None where it runs there:
        it exchanges its momentum over DDP's ranks, so only under parallel=ddp. The one rule of the optimiser
        against a layout: validation raises its error for the run's layout, and ``parallel=auto`` weighs only the
        candidates it leaves."""
        if layout.wrapper == "ddp" and not layout.shards_only_optimizer_state:
            return None
        return Refusal("optim", self.name, "another optimiser", "(1-bit Adam exchanges its momentum over DDP's "
                       f"ranks: parallel=ddp with data-parallel ranks runs it; this run: {layout.describe()})",
                       "layouts other than DDP (1-bit Adam exchanges its momentum over DDP's ranks)")

    def check_run(self, layout: Any, comm: Any) -> None:
        """Refuse a run whose gradients DDP does not average (``layout``: the run's ``Layout``), or whose
        gradients a ``comm`` codec already compresses."""
        refusal = self.layout_refusal(layout)
        if refusal is not None:
            raise refusal.error()
        if comm.name != "none":
            raise ConfigError("comm", comm.name, "none with optim=onebit_adam (it sends fp32 gradients during its "
                              "warm-up and its compressed momentum after)")


class OneBitAdam(torch.optim.AdamW):
    """torch's AdamW until the warm-up ends; after it, per step: m = beta1 m + (1 - beta1) g with this rank's
    own gradient g, m replaced by its compressed mean over ranks, and w -= lr (m / bc1) / (sqrt(v / bc2) + eps)
    after decoupled weight decay, v and bc2 = 1 - beta2^warmup as the warm-up left them (bc1 follows the step,
    as AdamW's). ``attach`` gives it the ranks; alone it runs the same steps without compression."""

    def __init__(self, params: Any, warmup_steps: int, **adamw: Any) -> None:
        super().__init__(params, **adamw)
        self.warmup_steps = warmup_steps
        """Steps of AdamW before the variance freezes."""
        self.exchange: Any = None
        """The ranks' ``disttrain.comm.momentum.MomentumExchange`` (None: one process, nothing to exchange)."""
        self.wire_name = "onebit_adam"
        """What the communication meter reports this optimiser's exchange as."""

    def attach(self, ddp: DistributedDataParallel, counter: Any, state: Any) -> None:
        """Exchange over ``ddp``'s ranks (before its first backward pass), counting bytes in ``counter`` (a
        ``ByteCounter``) and keeping the step count and residuals in ``state`` (an ``ExchangeState``)."""
        from disttrain.comm.momentum import MomentumExchange

        self.exchange = MomentumExchange(ddp, self.warmup_steps, counter, state)

    def _frozen(self) -> bool:
        """Whether this step runs with the variance frozen."""
        if self.exchange is not None:
            return self.exchange.compressing()
        steps = [state["step"] for state in self.state.values() if "step" in state]
        return bool(steps) and int(steps[0]) >= self.warmup_steps

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One AdamW step during the warm-up, one 1-bit Adam step after it."""
        loss = None
        if closure is not None:  # first: its backward pass is the exchange that decides the phase
            with torch.enable_grad():
                loss = closure()
        if not self._frozen():
            super().step()
            return loss
        moving = [(group, p) for group in self.param_groups for p in group["params"] if p.grad is not None]
        for group, p in moving:
            self.state[p]["exp_avg"].lerp_(p.grad, 1 - group["betas"][0])
        if self.exchange is not None:
            momenta = [self.state[p]["exp_avg"] for _, p in moving]
            mean = self.exchange.mean(torch.cat([m.reshape(-1).float() for m in momenta]))
            offset = 0
            for m in momenta:
                m.copy_(mean[offset:offset + m.numel()].view_as(m))
                offset += m.numel()
        for group, p in moving:
            state = self.state[p]
            state["step"] += 1
            beta1, beta2 = group["betas"]
            lr = group["lr"]
            bias_correction1 = 1 - beta1 ** float(state["step"])
            frozen_correction2 = math.sqrt(1 - beta2 ** self.warmup_steps)
            p.mul_(1 - lr * group["weight_decay"])
            denom = (state["exp_avg_sq"].sqrt() / frozen_correction2).add_(group["eps"])
            p.addcdiv_(state["exp_avg"], denom, value=-lr / bias_correction1)
        return loss


@OPTIMIZERS.register("onebit_adam", OneBitAdamConfig)
def build_onebit_adam(cfg: OneBitAdamConfig, model: nn.Module) -> OneBitAdam:
    """1-bit Adam over the (possibly wrapped) model's trainable parameters; the run attaches the exchange."""
    groups = param_groups(model, cfg.weight_decay, cfg.exclude_bias_and_norm)
    return OneBitAdam(groups, cfg.warmup_steps, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps,
                      weight_decay=cfg.weight_decay, **(kernel_options(groups) if cfg.fused else {}))
