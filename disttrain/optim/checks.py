"""Range checks shared by the optimiser config schemas; each raises ConfigError naming the full key."""

from __future__ import annotations

from disttrain.errors import ConfigError


def positive(key: str, value: float) -> None:
    """``value`` must be > 0 (learning rates, epsilons, trust coefficients)."""
    if not value > 0:
        raise ConfigError(key, value, "a positive number")


def non_negative(key: str, value: float) -> None:
    """``value`` must be >= 0 (weight decay)."""
    if not value >= 0:
        raise ConfigError(key, value, "a number >= 0")


def unit_interval(key: str, value: float) -> None:
    """``value`` must lie in [0, 1) (momentum, one beta)."""
    if not 0 <= value < 1:
        raise ConfigError(key, value, "a number in [0, 1)")


def betas(key: str, value: list[float]) -> None:
    """Two Adam-style averaging coefficients, each in [0, 1)."""
    if len(value) != 2 or not all(0 <= b < 1 for b in value):
        raise ConfigError(key, list(value), "two numbers [beta1, beta2], each in [0, 1)")
