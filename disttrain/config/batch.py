"""The batch numbers: set two of global, micro and accumulation, the third follows; all three must agree."""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.config.schema import BatchConfig
from disttrain.errors import ConfigError


@dataclass(frozen=True)
class ResolvedBatch:
    """The three batch numbers after resolution; ``global_size == micro_size * accumulation * dp``."""

    global_size: int
    """Samples per optimiser step over all data-parallel ranks."""
    micro_size: int
    """Samples per forward and backward on one rank."""
    accumulation: int
    """Micro-batches a rank accumulates into one optimiser step."""


def resolve_batch(batch: BatchConfig, dp: int) -> ResolvedBatch:
    """Derive the missing batch number from the two given ones and check all three agree."""
    for key in ("global_size", "micro_size", "accumulation"):
        value = getattr(batch, key)
        if value is not None and value <= 0:
            raise ConfigError(f"batch.{key}", value, "a positive integer, or null to derive it")
    g, m, a = batch.global_size, batch.micro_size, batch.accumulation
    if g is None:
        if m is None:
            raise ConfigError("batch.global_size", None, "set at least one of batch.global_size, batch.micro_size")
        a = a or 1
        return ResolvedBatch(m * a * dp, m, a)
    if m is None:
        a = a or 1
        if g % (dp * a):
            raise ConfigError(
                "batch.global_size", g,
                f"a multiple of data-parallel size x accumulation = {dp} x {a} = {dp * a}",
            )
        return ResolvedBatch(g, g // (dp * a), a)
    if a is None:
        if g % (dp * m):
            raise ConfigError(
                "batch.global_size", g,
                f"a multiple of data-parallel size x batch.micro_size = {dp} x {m} = {dp * m}",
            )
        return ResolvedBatch(g, m, g // (dp * m))
    if g != m * a * dp:
        raise ConfigError(
            "batch.global_size", g,
            f"must equal micro_size x accumulation x data-parallel size = {m} x {a} x {dp} = {m * a * dp}"
            " (set only two of the three)",
        )
    return ResolvedBatch(g, m, a)
