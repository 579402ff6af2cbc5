"""Client-level differential privacy: clipping each update, Gaussian noise on the mean, and the budget spent.

The budget comes from Opacus' RDP accountant (a maintained implementation of the moments accountant), fed
one step per round with sampling rate ``clients_per_round / clients``. The accountant assumes Poisson
sampling; rounds draw a fixed number of clients, the usual approximation in DP-FedAvg.
"""

from __future__ import annotations

import torch

from disttrain.counter_random import counter_random

_NOISE_TAG = 0xD1FF
_SEED_BITS = (1 << 63) - 1


def clip_update(update: torch.Tensor, clip: float) -> tuple[torch.Tensor, float]:
    """``update`` scaled to L2 norm at most ``clip``, and its norm before clipping."""
    norm = float(torch.linalg.vector_norm(update, dtype=torch.float64))
    if norm <= clip:
        return update, norm
    clipped = (update.double() * (clip / norm)).to(update.dtype)
    rounded = float(torch.linalg.vector_norm(clipped, dtype=torch.float64))
    if rounded > clip:  # rounding to the update's precision may land a hair above the bound: step inside it
        clipped = clipped * (clip / rounded * (1 - 1e-6))
    return clipped, norm


def gaussian_noise(numel: int, std: float, seed: int, round_index: int) -> torch.Tensor:
    """Noise of the round, the same on every rank (seeded by the run and the round, so a resumed run adds the
    same noise)."""
    generator = torch.Generator().manual_seed(counter_random(seed ^ _NOISE_TAG, round_index, 0) & _SEED_BITS)
    return torch.randn(numel, generator=generator, dtype=torch.float64) * std


def epsilon(noise_multiplier: float, sample_rate: float, rounds: int, delta: float) -> float:
    """Epsilon at ``delta`` after ``rounds`` rounds (inf without noise, 0 before the first round)."""
    if rounds == 0:
        return 0.0
    if noise_multiplier == 0:
        return float("inf")
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [(noise_multiplier, sample_rate, rounds)]
    return float(accountant.get_epsilon(delta))
