"""A training step's loss as the mean over every real target of its batch, whatever the layout.

Where the data marks targets ``IGNORE_INDEX`` (a conversation's prompt, padding), micro-batches, context-parallel
shards and pipeline microbatches hold different numbers of real targets, and the mean of their means is not the
mean over the step's targets that one process holding the whole batch takes (what transformers' trainer takes with
``num_items_in_batch``). The decision (``ExecutionPlan.loss_mean``) is made once; this module carries it out.

How. Backward runs on each micro-batch's summed loss divided by its number of target positions (real or not, the
same on every micro-batch of a run: so every layout averages gradients over equal parts as it does when every
target is real). Before the step's gradients are clipped or their norm taken, one all-reduce sums each rank's
loss, real targets and positions (the preemption flag rides with them), and the gradients are multiplied once by
positions / real targets: the gradient of the summed loss over the step's real targets divided by their count. The
same factor holds on ranks that computed no loss (a pipeline's first stages), since the reduce gives every rank
the totals; ranks holding copies of the same targets (tensor-parallel peers) add to both totals alike, so the ratio
is unchanged. torchft's replica groups average their totals with their gradients, in the same cross-group call.

Why after backward rather than knowing the count before it: the count of a step's later micro-batches and of the
other ranks' is known only once their batches are read, and reading them ahead would mean a second pass over the
data or a data loader that holds a whole accumulation window. Dividing by the positions rather than by 1 keeps the
gradients in backward at the size they have when every target is real (what gradient compression, its
error-feedback residuals and fp16 loss scaling see), and makes the factor exactly 1 there. A step with no real
target at all divides by one: its loss is 0 and its gradients stay zero (no division by zero anywhere, nor on a
shard or micro-batch that holds none).

A mixture-of-experts balance loss whose gradient is added inside backward is scaled by the factor too.
"""

from __future__ import annotations

import torch

from disttrain.data.base import IGNORE_INDEX
from disttrain.fault.steps import StepAgreement


class StepTargets:
    """This rank's summed loss, real targets and target positions of the step being taken, turned once per step
    into the step's loss and the factor its gradients are scaled by.

    ``scope``: "step", the totals of every rank (gradients averaged over the ranks every step); "replica", this
    rank's own (replicas that step apart; the logged loss is then the mean of the replicas' losses)."""

    def __init__(self, scope: str) -> None:
        self.scope = scope
        """"step" or "replica" (``ExecutionPlan.loss_mean``)."""
        self._totals: torch.Tensor | None = None
        """float64 ``[loss sum, real targets, positions]`` of the step's micro-batches so far (None: none yet)."""

    def add(self, loss_sum: torch.Tensor, targets: torch.Tensor) -> None:
        """Count a micro-batch: its loss summed over its real targets, and its targets."""
        part = torch.stack([loss_sum.detach().double().reshape(()), (targets != IGNORE_INDEX).sum().double(),
                            torch.tensor(float(targets.numel()), dtype=torch.float64, device=targets.device)])
        self._totals = part if self._totals is None else self._totals + part

    def take(self, agreement: StepAgreement, world_size: int, device: torch.device) -> tuple[torch.Tensor,
                                                                                              torch.Tensor]:
        """The step's loss (the same on every rank) and the factor of its gradients; the totals start over.
        A collective on every rank: the totals' all-reduce (scope "step") or the logged mean's (scope "replica")."""
        loss, factor = mean_and_factor(self.reduced(agreement, device))
        if self.scope == "replica":
            loss = agreement.reduce_loss(loss, world_size)
        return loss, factor

    def reduced(self, agreement: StepAgreement, device: torch.device) -> torch.Tensor:
        """The step's totals (``[loss sum, real targets, positions]``): summed over all ranks under scope "step",
        this rank's own under "replica"; they start over."""
        totals = self._totals if self._totals is not None else torch.zeros(3, dtype=torch.float64, device=device)
        self._totals = None
        return agreement.reduce_sums(totals) if self.scope == "step" else totals


def mean_and_factor(totals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss over the real targets of ``totals`` (``[loss sum, real targets, positions]``, any common multiple
    of them), and the factor that turns gradients of the summed losses / positions into that mean's."""
    loss_sum, count, positions = totals.unbind()
    count = count.clamp(min=1.0)
    return (loss_sum / count).float(), (positions / count).float()
