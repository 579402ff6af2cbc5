"""Simulated client speeds: how long each client's local training takes, in simulated time.

A time unit is the local training of a typical fast client. Each run of local training takes
``exp(spread x z)`` units, ``z`` a standard normal drawn from the seed and the run, times ``slowdown`` for the
slow clients (a share drawn once from the seed). Synchronous and asynchronous runs draw from the same
distribution, so their simulated times compare.
"""

from __future__ import annotations

import math

import torch

from disttrain.counter_random import seeded_generator

_SLOW_STREAM, _LATENCY_STREAM = 12, 11


def slow_clients(fraction: float, clients: int, seed: int) -> set[int]:
    """The ``round(fraction x clients)`` slow clients, from the seed alone."""
    count = round(fraction * clients)
    if not count:
        return set()
    return {int(c) for c in torch.randperm(clients, generator=seeded_generator(seed, _SLOW_STREAM))[:count]}


def duration(seed: int, client: int, slow: bool, spread: float, slowdown: float, *run: int) -> float:
    """Simulated time of one run of local training by ``client``, ``run`` naming the run (a round, a launch)."""
    z = float(torch.randn((), generator=seeded_generator(seed, _LATENCY_STREAM, client, *run)))
    return math.exp(spread * z) * (slowdown if slow else 1.0)
