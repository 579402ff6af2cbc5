"""One simulated client: its data stream, its local training from the global model, its evaluation.

A client reads its partition as an endless stream of local epochs: the first in partition order, each later
one a permutation drawn from ``(seed, epoch, client)``. With ``local_steps`` K and batch B, round r reads
samples ``[r K B, (r + 1) K B)`` of that stream, so a round's data depends on nothing but the round, and a run
resumed at a round boundary reads what the uninterrupted run read. With ``local_epochs`` E, each round makes
E fresh passes (last batch partial), each a permutation drawn from ``(seed, round, epoch, client)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from disttrain.counter_random import seeded_generator
from disttrain.loss import token_cross_entropy
from disttrain.optim import build_optimizer
from disttrain.parallel.clip import clip_grad_norm


@dataclass
class ClientData:
    """Client ``client``'s samples (``indices`` into ``dataset``) and how it batches them."""

    dataset: Dataset
    """The training split the clients share."""
    indices: torch.Tensor
    """This client's samples of it."""
    client: int
    """The client's number (seeds its shuffling)."""
    batch_size: int
    """Samples per local step."""
    seed: int
    """The run's seed."""

    def __len__(self) -> int:
        return len(self.indices)

    def _local_epoch(self, epoch: int) -> torch.Tensor:
        if epoch == 0:
            return self.indices
        order = torch.randperm(len(self.indices), generator=seeded_generator(self.seed, 1, epoch, self.client))
        return self.indices[order]

    def step_batches(self, round_index: int, steps: int) -> list[torch.Tensor]:
        """The ``steps`` batches of round ``round_index`` taken from the client's stream."""
        size, count = self.batch_size, len(self.indices)
        start, stop = round_index * steps * size, (round_index + 1) * steps * size
        orders = [self._local_epoch(epoch) for epoch in range(start // count, (stop - 1) // count + 1)]
        window = torch.cat(orders)[start - (start // count) * count:][:stop - start]
        return list(window.split(size))

    def epoch_batches(self, round_index: int, epochs: int) -> list[torch.Tensor]:
        """``epochs`` fresh passes over the client's data in round ``round_index``."""
        batches = []
        for epoch in range(epochs):
            order = torch.randperm(len(self.indices), generator=seeded_generator(self.seed, 2, round_index, epoch,
                                                                          self.client))
            batches += list(self.indices[order].split(self.batch_size))
        return batches

    def eval_batches(self, limit: int) -> list[torch.Tensor]:
        """Up to ``limit`` batches of the client's data, in partition order."""
        return list(self.indices.split(self.batch_size))[:limit]

    def collate(self, batch: torch.Tensor) -> Any:
        """The samples of ``batch`` stacked into one batch."""
        return default_collate([self.dataset[int(i)] for i in batch])


def loss_of(net: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> tuple[torch.Tensor,
                                                                                                       torch.Tensor]:
    """Cross-entropy of ``net`` on a batch (classes or next tokens), and the logits."""
    logits = net(inputs)
    return token_cross_entropy(logits, targets, reduction), logits


def copy_state(source: list[torch.Tensor], target: list[torch.Tensor]) -> None:
    """Copy tensors into tensors of the same shapes (the global model into a client's working copy)."""
    with torch.no_grad():
        torch._foreach_copy_(target, source)


def train_locally(net: nn.Module, batches: list[Any], optim_cfg: Any, clip: float | None, mu: float,
                  anchor: list[torch.Tensor] | None, device: torch.device) -> float:
    """Train ``net`` (already holding the global model) on ``batches`` with a fresh optimiser of ``optim_cfg``,
    clipping each step's gradient to ``clip``; FedProx adds ``mu * (w - anchor)`` to each gradient. Returns the
    mean training loss."""
    net.train()
    optimizer = build_optimizer(optim_cfg, net)
    params = [p for p in net.parameters() if p.requires_grad]
    losses = []
    for inputs, targets in batches:
        optimizer.zero_grad(set_to_none=True)
        loss, _ = loss_of(net, inputs.to(device), targets.to(device))
        loss.backward()
        if mu:  # the gradient of mu / 2 * ||w - w_global||^2
            with torch.no_grad():
                for param, start in zip(params, anchor, strict=True):
                    param.grad.add_(param - start, alpha=mu)
        if clip:
            clip_grad_norm(params, clip)
        optimizer.step()
        losses.append(loss.detach())
    return float(torch.stack(losses).mean()) if losses else float("nan")


@torch.no_grad()
def evaluate(net: nn.Module, batches: list[Any], device: torch.device) -> tuple[float, float, int]:
    """Correct predictions, summed loss and target count of ``net`` on ``batches`` (eval mode)."""
    net.eval()
    correct, loss_sum, count = 0.0, 0.0, 0
    for inputs, targets in batches:
        targets = targets.to(device)
        loss, logits = loss_of(net, inputs.to(device), targets, reduction="sum")
        correct += float((logits.argmax(-1) == targets).sum())
        loss_sum += float(loss)
        count += targets.numel()
    return correct, loss_sum, count
