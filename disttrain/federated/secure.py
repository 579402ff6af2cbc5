"""Secure aggregation by pairwise additive masks (Bonawitz et al., 2017), without dropout recovery.

Each client encodes its update in fixed point modulo ``2^48`` and, for every other client of the round,
adds (lower id) or subtracts (higher id) a mask that the pair derives from a shared seed. Every mask appears
once with each sign, so the masks cancel exactly in the modular sum and only the sum can be decoded; a
single masked update is uniform noise. In deployment the pair's seed comes from a key agreement between the
two clients; in this simulation it is derived from the run's seed, the round and the pair. A client that
drops out after masking would leave its masks in the sum: the protocol's recovery step is not implemented,
so every sampled client must report.
"""

from __future__ import annotations

import torch

from disttrain.data.base import counter_random

MODULUS_BITS = 48
MODULUS = 1 << MODULUS_BITS
FRACTION_BITS = 24
"""Fixed point: values are multiples of 2^-24 (6e-8) with magnitude below 2^23."""
_MASK_TAG = 0x5EC0
_SEED_BITS = (1 << 63) - 1


def encode(values: torch.Tensor) -> torch.Tensor:
    """``values`` as fixed-point residues in [0, 2^48) (int64)."""
    scaled = torch.round(values.detach().double() * (1 << FRACTION_BITS))
    limit = 1 << (MODULUS_BITS - 2)
    if scaled.abs().max() >= limit:
        raise RuntimeError(f"secure aggregation: an update value of magnitude {float(values.abs().max()):.3g} is "
                           f"beyond the fixed-point range (below 2^{MODULUS_BITS - 2 - FRACTION_BITS})")
    return torch.remainder(scaled.long(), MODULUS)


def decode(residues: torch.Tensor) -> torch.Tensor:
    """The signed values (float64) of a sum of encoded residues."""
    reduced = torch.remainder(residues, MODULUS)
    signed = torch.where(reduced >= MODULUS // 2, reduced - MODULUS, reduced)
    return signed.double() / (1 << FRACTION_BITS)


def pair_mask(seed: int, round_index: int, low: int, high: int, numel: int) -> torch.Tensor:
    """The mask clients ``low < high`` share in this round: uniform residues from their pair seed."""
    pair_seed = counter_random(seed ^ _MASK_TAG, round_index, low * (1 << 32) + high) & _SEED_BITS
    generator = torch.Generator().manual_seed(pair_seed)
    return torch.randint(0, MODULUS, (numel,), generator=generator, dtype=torch.int64)


def mask(encoded: torch.Tensor, client: int, participants: list[int], seed: int, round_index: int) -> torch.Tensor:
    """``encoded`` (on the CPU) plus the client's masks with every other participant, modulo 2^48."""
    masked = encoded.clone()
    for other in participants:
        if other == client:
            continue
        shared = pair_mask(seed, round_index, min(client, other), max(client, other), encoded.numel())
        masked = masked + shared if client < other else masked - shared
    return torch.remainder(masked, MODULUS)
