"""Range checks shared by every config schema; each raises one ConfigError naming the full key."""

from __future__ import annotations

from typing import Any

from disttrain.errors import ConfigError


def one_of(key: str, value: Any, allowed: tuple[str, ...]) -> None:
    """``value`` must be one of ``allowed`` (a setting that names a choice)."""
    if value not in allowed:
        raise ConfigError(key, value, f"one of {', '.join(allowed)}")


def positive(key: str, value: float | None, optional: bool = False) -> None:
    """``value`` must be > 0 (or None when ``optional``): learning rates, sizes, counts."""
    if value is None and optional:
        return
    if value is None or not value > 0:
        raise ConfigError(key, value, "a positive number" + (", or null" if optional else ""))


def non_negative(key: str, value: float) -> None:
    """``value`` must be >= 0 (weight decay, worker processes)."""
    if not value >= 0:
        raise ConfigError(key, value, "a number >= 0")


def unit_interval(key: str, value: float) -> None:
    """``value`` must lie in [0, 1) (momentum, one beta)."""
    if not 0 <= value < 1:
        raise ConfigError(key, value, "a number in [0, 1)")


def probability(key: str, value: float) -> None:
    """``value`` must lie in [0, 1) (dropout)."""
    if not 0.0 <= value < 1.0:
        raise ConfigError(key, value, "a probability in [0, 1)")


def fraction(key: str, value: float) -> None:
    """``value`` must lie strictly between 0 and 1 (a share of a data set)."""
    if not 0.0 < value < 1.0:
        raise ConfigError(key, value, "a fraction strictly between 0 and 1")


def held_out_fractions(val_fraction: float, test_fraction: float, below: float) -> None:
    """``data.val_fraction`` and ``data.test_fraction`` each in (0, 1), together below ``below`` (so that
    training data remains)."""
    fraction("data.val_fraction", val_fraction)
    fraction("data.test_fraction", test_fraction)
    if val_fraction + test_fraction >= below:
        raise ConfigError("data.test_fraction", test_fraction,
                          f"val_fraction + test_fraction below {below:g} (val_fraction is {val_fraction})")


def betas(key: str, value: list[float]) -> None:
    """Two Adam-style averaging coefficients, each in [0, 1)."""
    if len(value) != 2 or not all(0 <= b < 1 for b in value):
        raise ConfigError(key, list(value), "two numbers [beta1, beta2], each in [0, 1)")


def count_or_fraction(key: str, value: Any, allow_zero: bool) -> None:
    """Lightning's convention for batch limits: an int counts batches, a float is a fraction (1.0: all)."""
    if value is None:
        return
    least = 0 if allow_zero else 1
    if isinstance(value, int) and not isinstance(value, bool):
        if value < least:
            raise ConfigError(key, value, f"a count of batches >= {least} (an int), or a fraction in (0, 1] (a float)")
    elif isinstance(value, float):
        if not (0.0 < value <= 1.0 or (allow_zero and value == 0.0)):
            raise ConfigError(key, value, "a fraction in (0, 1] (a float), or a count of batches (an int)")
    else:
        raise ConfigError(key, value, "a count of batches (an int), a fraction in (0, 1] (a float), or null")
