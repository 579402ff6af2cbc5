"""Byzantine-robust aggregation rules: what replaces the mean of the client updates when some clients lie.

Each rule takes the round's updates as the rows of one ``(clients, numel)`` matrix and returns one update;
the server's optimiser then steps on it exactly as it would on the mean. The robust rules treat clients
alike (no sample weights: a client's reported count is as forgeable as its update).

- ``median``: the coordinate-wise median (Yin et al., 2018); with an even count, the mean of the two middle
  values.
- ``trimmed_mean``: per coordinate, drop the ``floor(trim_fraction * n)`` largest and smallest values and
  average the rest (Yin et al., 2018).
- ``krum``: the one update whose summed squared distance to its ``n - f - 2`` nearest others is smallest
  (Blanchard et al., 2017), for ``f`` assumed attackers; needs ``n > 2 f + 2``.
- ``multi_krum``: the mean of the ``n - f`` updates with the best Krum scores (El Mhamdi et al., 2018).
"""

from __future__ import annotations

import math

import torch

RULES = ("mean", "median", "trimmed_mean", "krum", "multi_krum")
KRUM_RULES = ("krum", "multi_krum")
"""The rules that assume a number of attackers (``federated.assumed_attackers``)."""


def trimmed_count(clients: int, trim_fraction: float) -> int:
    """Values dropped from each end of every coordinate by ``trimmed_mean`` over ``clients`` updates."""
    return math.floor(trim_fraction * clients)


def median(updates: torch.Tensor) -> torch.Tensor:
    """The coordinate-wise median of the rows (mean of the two middle values for an even count)."""
    ordered = updates.sort(dim=0).values
    n = ordered.shape[0]
    if n % 2:
        return ordered[n // 2].clone()
    return ((ordered[n // 2 - 1].double() + ordered[n // 2].double()) / 2).to(updates.dtype)


def trimmed_mean(updates: torch.Tensor, trim_fraction: float) -> torch.Tensor:
    """Per coordinate, the mean of the rows left after dropping the ``floor(trim_fraction * n)`` largest and
    smallest values."""
    n = updates.shape[0]
    cut = trimmed_count(n, trim_fraction)
    if 2 * cut >= n:
        raise ValueError(f"trimmed mean: trimming {cut} of {n} updates from each end leaves none")
    kept = updates.sort(dim=0).values[cut:n - cut]
    return kept.double().mean(dim=0).to(updates.dtype)


def krum_scores(updates: torch.Tensor, attackers: int) -> torch.Tensor:
    """Each row's Krum score: the summed squared distance to its ``n - attackers - 2`` nearest other rows."""
    n = updates.shape[0]
    neighbours = n - attackers - 2
    if n <= 2 * attackers + 2:
        raise ValueError(f"krum: {n} updates cannot outvote {attackers} attackers (needs n > 2f + 2)")
    rows = updates.double()
    squared = (rows * rows).sum(dim=1)
    # |a - b|^2 = |a|^2 + |b|^2 - 2 a.b: one matrix product instead of n^2 subtractions
    distances = (squared[:, None] + squared[None, :] - 2 * rows @ rows.T).clamp_min(0)
    distances.fill_diagonal_(math.inf)
    return distances.sort(dim=1).values[:, :neighbours].sum(dim=1)


def krum_selection(updates: torch.Tensor, attackers: int, keep: int) -> list[int]:
    """The ``keep`` rows with the lowest Krum scores (ties to the lower index), ascending."""
    scores = krum_scores(updates, attackers)
    order = sorted(range(len(scores)), key=lambda i: (float(scores[i]), i))
    return sorted(order[:keep])


def aggregate(updates: torch.Tensor, rule: str, trim_fraction: float = 0.0, attackers: int = 0) -> torch.Tensor:
    """The round's update under ``rule`` from the rows of ``updates`` (one per reporting client)."""
    if rule == "mean":
        return updates.double().mean(dim=0).to(updates.dtype)
    if rule == "median":
        return median(updates)
    if rule == "trimmed_mean":
        return trimmed_mean(updates, trim_fraction)
    if rule == "krum":
        return updates[krum_selection(updates, attackers, 1)[0]].clone()
    if rule == "multi_krum":
        chosen = krum_selection(updates, attackers, updates.shape[0] - attackers)
        return updates[chosen].double().mean(dim=0).to(updates.dtype)
    raise ValueError(f"unknown aggregation rule {rule!r}: one of {list(RULES)}")
