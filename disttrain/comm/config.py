"""The ``comm`` config group: how data-parallel gradients travel between ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from disttrain import checks
from disttrain.errors import ConfigError, Refusal

CODECS = ("none", "fp16", "bf16", "powersgd", "int8", "onebit")
"""none: fp32 all-reduce (DDP's own); fp16/bf16: cast for the wire; powersgd: low-rank factors; int8: 8-bit
codes with stochastic rounding; onebit: signs and a mean magnitude. All are reduced in fp32."""

DEFAULT_POWERSGD_RANK = 16
"""PowerSGD's rank where none is given: on GPT nano under AdamW it tracks fp32 from the first step, where rank 4
and 8 ended above it even after 100 fp32 steps (benchmarks/README.md, Figures cited elsewhere)."""

SHARDED_CODECS = ("none", "fp16", "bf16")
"""What ZeRO-2/3 can send: FSDP2 reduce-scatters gradients itself, in its ``reduce_dtype``."""


@dataclass
class CommConfig:
    """How data-parallel gradients are sent: by DDP (``parallel=ddp``, ``zero1``) through a codec, or by FSDP2
    (ZeRO-2/3, hybrid sharding) in a reduce dtype."""

    name: str = "none"
    """What gradients are sent as: none (fp32), fp16, bf16, powersgd, int8 or onebit."""
    error_feedback: bool = True
    """Add what each compression left out to the next payload (powersgd, int8, onebit); the residuals are in
    the checkpoint."""
    rank: int | None = None
    """powersgd: rank of the factors P (n x rank) and Q (m x rank) that stand for an n x m gradient matrix.
    null: ``DEFAULT_POWERSGD_RANK``, or the largest rank at which some matrix of the model still shrinks where
    that is smaller (rank 4 and 8 fall behind fp32 on a transformer under AdamW; benchmarks/README.md)."""
    warmup_steps: int = 0
    """Optimiser steps whose gradients are sent as a plain fp32 all-reduce before the codec starts (powersgd,
    int8, onebit, fp16, bf16). Absolute steps, not a fraction: the switch then falls on the same step whatever
    the run's length or a resume's. Counted in exchanges, one per optimiser step (accumulation micro-batches
    do not communicate); the count is in the checkpoint, so a run resumed inside the warm-up finishes it and
    one resumed past it compresses."""

    def validate(self) -> None:
        """Raise ConfigError for an unknown codec or an impossible option."""
        checks.one_of("comm.name", self.name, CODECS)
        if self.rank is not None and self.rank < 1:
            raise ConfigError("comm.rank", self.rank, "a positive rank, or null")
        if self.warmup_steps < 0:
            raise ConfigError("comm.warmup_steps", self.warmup_steps, "a number of optimiser steps >= 0")

    def check_layout(self, layout: Any, sync_every: int = 0, servers: int = 0) -> None:
        """Refuse a codec on a layout whose gradients it cannot carry (``layout``: the run's
        ``disttrain.parallel.layout.Layout``; ``sync_every`` and ``servers``: ``parallel``'s)."""
        if self.name == "none":
            return
        if sync_every:
            raise ConfigError("comm", self.name, f"none with parallel.sync_every={sync_every} (replicas that meet "
                              "in outer steps exchange parameters, not gradients)")
        if servers:
            raise ConfigError("comm", self.name, "none with a parameter server (parallel.servers > 0: it sends fp32 "
                              "gradients and parameters point to point)")
        refusal = self.layout_refusal(layout)
        if refusal is not None:
            raise refusal.error()

    def layout_refusal(self, layout: Any) -> Refusal | None:
        """How the codec refuses ``layout`` (a ``disttrain.parallel.layout.Layout``), or None where it runs there:
        it needs data-parallel ranks whose gradients DDP exchanges as one model's (no pipeline stages), and under
        ZeRO-2/3 a reduce dtype FSDP2 sends. The one rule of the codec against a layout: validation raises its
        error for the run's layout, and ``parallel=auto`` weighs only the candidates it leaves."""
        if self.name == "none":
            return None
        if layout.dp < 2:
            return Refusal("comm", self.name, "none", "on a run without data-parallel ranks (nothing to exchange)",
                           "layouts without data-parallel ranks (nothing to exchange)")
        if layout.pp_enabled:
            return Refusal("comm", self.name, "none", "with pipeline stages (their gradients are not exchanged by DDP "
                           "or FSDP2 as one model's)", "pipelines (their gradients are not exchanged by DDP or FSDP2 "
                           "as one model's)")
        if layout.shards_parameters and self.name not in SHARDED_CODECS:
            return Refusal("comm", self.name, f"one of {', '.join(SHARDED_CODECS)}", f"with {layout.zero_name} "
                           "(FSDP2 reduce-scatters the gradients in a reduce dtype; the other codecs compress DDP's "
                           "all-reduce: parallel=ddp or zero1)", "layouts that shard parameters (ZeRO-2/3: FSDP2 "
                           "reduce-scatters the gradients in a reduce dtype)")
        return None

    def check_model(self, net: Any) -> None:
        """Resolve an unset PowerSGD rank for ``net`` (a meta-device model), and refuse a rank at which none of
        its gradient matrices gets smaller."""
        if self.name != "powersgd":
            return
        from disttrain.comm.powersgd import largest_useful_rank

        useful = largest_useful_rank([param.shape for param in net.parameters() if param.requires_grad])
        if self.rank is None:
            self.rank = max(1, min(DEFAULT_POWERSGD_RANK, useful))
        if self.rank > useful:
            raise ConfigError("comm.rank", self.rank,
                              f"at most {useful}: above it no gradient matrix of this model is smaller as "
                              f"rank-{self.rank} factors (every value would be sent uncompressed)")
