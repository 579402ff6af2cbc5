"""The one loss of every kind of run: cross-entropy over the last dimension of the logits, with targets of
``IGNORE_INDEX`` (evaluation padding) counted nowhere. The task, the pipeline's last stage and federated clients
all compute it here."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from disttrain.data.base import IGNORE_INDEX


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``logits`` over their last dimension against ``targets`` (``IGNORE_INDEX`` counts nowhere)."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction=reduction,
                           ignore_index=IGNORE_INDEX)
