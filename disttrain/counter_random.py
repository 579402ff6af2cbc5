"""Counter-based random numbers: a draw depends only on its seed and its coordinates (an epoch and a sample, a
round and a client), never on a generator's state, so every rank, loader worker and restarted run draws alike.

Kept apart from the data and federated packages, which both use it: the configuration layer checks federated
settings (which attacks exist) without importing the data modules or Lightning.
"""

from __future__ import annotations

import numpy as np
import torch

_MASK64 = (1 << 64) - 1
_SEED_BITS = (1 << 63) - 1  # torch.Generator.manual_seed takes a non-negative int64


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def counter_random(seed: int, epoch: int, index: int) -> int:
    """A uniform 64-bit random number that depends only on ``(seed, epoch, index)``.

    A counter-based generator: sample ``index`` of ``epoch`` draws the same number in every run, rank and
    loader worker, without any generator state to carry between processes.
    """
    return _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ (epoch & _MASK64)) ^ (index & _MASK64))


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    # uint64 arrays wrap modulo 2**64 as the masks above do
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def counter_random_array(seed: int, epochs: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """``counter_random(seed, epoch, index)`` for arrays of epochs and indices at once (uint64, the same bits):
    a batch's draws in a few array operations instead of a Python call per sample."""
    first = _splitmix64_array(np.full(1, seed & _MASK64, dtype=np.uint64))
    second = _splitmix64_array(first ^ np.asarray(epochs, dtype=np.int64).astype(np.uint64))
    return _splitmix64_array(second ^ np.asarray(indices, dtype=np.int64).astype(np.uint64))


def seeded_generator(seed: int, *parts: int) -> torch.Generator:
    """A torch generator seeded by ``seed`` and ``parts`` alone (the same on every rank, in every run)."""
    value = seed
    for part in parts:
        value = counter_random(value, part, 0)
    return torch.Generator().manual_seed(value & _SEED_BITS)
