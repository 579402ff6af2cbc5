"""Simulated hostile clients: which clients attack, and what they send instead of an honest update.

A fixed share of the clients (drawn once from the run's seed) attack in every round they are drawn:

- ``sign_flip``: send ``-scale`` times the honest update (pushes the model the other way);
- ``scale``: send ``scale`` times the honest update (a boosted update that dominates a mean);
- ``random``: send Gaussian noise whose per-coordinate RMS is ``scale`` times the honest update's;
- ``label_flip``: train honestly on labels mapped ``y -> classes - 1 - y`` (data poisoning; ``scale`` unused).
"""

from __future__ import annotations

from typing import Any

import torch

from disttrain.counter_random import seeded_generator

ATTACKS = ("none", "sign_flip", "scale", "random", "label_flip")
_ATTACKER_STREAM, _NOISE_STREAM = 6, 7


def attackers(fraction: float, clients: int, seed: int) -> set[int]:
    """The ``round(fraction * clients)`` hostile clients, drawn from the run's seed alone."""
    count = round(fraction * clients)
    if not count:
        return set()
    return {int(c) for c in torch.randperm(clients, generator=seeded_generator(seed, _ATTACKER_STREAM))[:count]}


def poison(update: torch.Tensor, kind: str, scale: float, seed: int, round_index: int, client: int) -> torch.Tensor:
    """What a hostile client sends in place of its honest ``update`` (``label_flip`` poisons data, not this)."""
    if kind == "sign_flip":
        return update * -scale
    if kind == "scale":
        return update * scale
    if kind == "random":
        rms = float(torch.linalg.vector_norm(update, dtype=torch.float64)) / max(update.numel(), 1) ** 0.5
        noise = torch.randn(update.numel(), generator=seeded_generator(seed, _NOISE_STREAM, round_index, client))
        return (noise * (scale * rms)).to(update)
    return update


def flip_labels(batches: list[Any], classes: int) -> list[Any]:
    """``batches`` with every class label ``y`` replaced by ``classes - 1 - y``."""
    return [(inputs, classes - 1 - targets) for inputs, targets in batches]
