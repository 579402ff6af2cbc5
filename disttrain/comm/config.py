"""The ``comm`` config group: how data-parallel gradients travel between ranks."""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.errors import ConfigError

CODECS = ("none", "fp16", "bf16", "int8", "onebit")
"""none: fp32 all-reduce (DDP's own); fp16/bf16: cast for the wire; int8: 8-bit codes with stochastic
rounding; onebit: signs and a mean magnitude. All are reduced in fp32."""


@dataclass
class CommConfig:
    """Gradient compression for the data-parallel all-reduce of DDP (``parallel=ddp`` and ``zero1``)."""

    name: str = "none"
    """What gradients are sent as: none (fp32, DDP's own all-reduce), fp16, bf16, int8 or onebit."""
    error_feedback: bool = True
    """Add what each compression left out to the next payload of the same bucket (int8, onebit); the
    residuals are in the checkpoint."""

    def validate(self) -> None:
        """Raise ConfigError for an unknown codec."""
        if self.name not in CODECS:
            raise ConfigError("comm.name", self.name, f"one of {', '.join(CODECS)}")

    def check_layout(self, zero_stage: int, pipelined: bool, data_parallel: int) -> None:
        """Refuse a codec on a layout whose gradients do not go through DDP's all-reduce."""
        if self.name == "none":
            return
        if data_parallel < 2:
            raise ConfigError("comm", self.name, "none on a run without data-parallel ranks (nothing to exchange)")
        if zero_stage in (2, 3) or pipelined:
            raise ConfigError("comm", self.name, "none with ZeRO-2/3, hybrid sharding or pipeline stages: the "
                              "codecs compress DDP's gradient all-reduce (parallel=ddp or zero1)")
