"""An evaluation loss per source, where the evaluation batches say which source each target comes from.

A data module whose evaluation batches are ``(inputs, targets, sources)`` (``sources`` shaped as the targets: the
index of each target's source, e.g. a mixture's held-out documents source after source) names its sources in
``DataSpec.eval_sources``; the task's ``EvalMetrics`` (``disttrain.rank.eval_metrics``) then keeps one
``SourceLoss`` per stage beside its overall loss. The per-source loss is the mean cross-entropy over that source's
real targets (``IGNORE_INDEX`` padding counts nowhere), summed and counted over all ranks at the epoch's end as the
overall loss's metric is, so it is the loss one process computes on that source's windows alone.
"""

from __future__ import annotations

import torch
from torchmetrics import Metric

from disttrain.data.base import IGNORE_INDEX


class SourceLoss(Metric):
    """Summed loss and number of real targets of each of ``num_sources`` sources over an evaluation epoch."""

    full_state_update = False

    def __init__(self, num_sources: int) -> None:
        super().__init__()
        # float64: an epoch's sums of many tokens' losses stay exact to well below the 1e-6 the losses are read at
        self.add_state("sums", torch.zeros(num_sources, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("counts", torch.zeros(num_sources, dtype=torch.float64), dist_reduce_fx="sum")

    def update(self, token_losses: torch.Tensor, targets: torch.Tensor, sources: torch.Tensor) -> None:
        """Add a batch's per-target losses (``token_losses``, shaped as ``targets``) to the sums of their sources."""
        real = (targets != IGNORE_INDEX).reshape(-1)
        index = sources.reshape(-1)[real].long()
        self.sums.index_add_(0, index, token_losses.reshape(-1)[real].double())
        self.counts.index_add_(0, index, torch.ones_like(index, dtype=torch.float64))

    def compute(self) -> torch.Tensor:
        """``[2, num_sources]``: each source's mean loss over its real targets and their number, summed over all
        ranks (a source with none: mean nan, number 0)."""
        return torch.stack([self.sums / self.counts, self.counts]).float()
