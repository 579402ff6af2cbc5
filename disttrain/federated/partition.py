"""Dividing a training split among clients: iid, Dirichlet over labels, or label-sorted shards.

Every partition is a function of the run's seed alone, so each rank computes the same one without
communication. The iid partition of ``C`` clients is the first epoch of a ``DistributedSampler`` over ``C``
replicas (client ``c`` holds ``perm[c::C]`` of the seeded permutation), so FedAvg with one client per rank
sees the samples that data parallelism gives the ranks in their first epoch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from disttrain.errors import ConfigError


def labels_of(dataset: Dataset) -> torch.Tensor | None:
    """The class label of every sample (from a ``labels`` or ``targets`` attribute, else read sample by sample);
    None for data whose targets are not one class per sample (token windows)."""
    for name in ("labels", "targets"):
        held = getattr(dataset, name, None)
        if held is not None:
            return torch.as_tensor(held).reshape(-1)
    first = dataset[0][1]
    if torch.as_tensor(first).numel() != 1:
        return None
    return torch.tensor([int(dataset[i][1]) for i in range(len(dataset))])  # type: ignore[arg-type]


class Partition(Sequence):
    """Every client's sample indices as one flat index tensor and the offsets where each client's run starts:
    two tensors whatever the number of clients (``partition[c]`` is a view of client ``c``'s run)."""

    def __init__(self, indices: torch.Tensor, offsets: torch.Tensor) -> None:
        self.indices, self.offsets = indices, offsets

    @classmethod
    def of(cls, parts: Sequence[Any]) -> Partition:
        """The partition whose client ``c`` holds ``parts[c]`` (index arrays or tensors)."""
        sizes = torch.tensor([len(part) for part in parts], dtype=torch.int64)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)])
        flat = np.concatenate([np.asarray(part, dtype=np.int64) for part in parts]) if len(parts) else []
        return cls(torch.as_tensor(flat, dtype=torch.int64), offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, client: int) -> torch.Tensor:  # type: ignore[override]
        if not -len(self) <= client < len(self):
            raise IndexError(f"client {client} of {len(self)}")
        client %= len(self)
        return self.indices[int(self.offsets[client]):int(self.offsets[client + 1])]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[client] for client in range(len(self)))

    def sizes(self) -> torch.Tensor:
        """Samples held by each client."""
        return self.offsets.diff()


def partition(num_samples: int, clients: int, scheme: str, seed: int, labels: torch.Tensor | None = None,
              alpha: float = 0.5, classes_per_client: int = 2) -> Partition:
    """Sample indices of each client, in the order the client reads them in its first local epoch."""
    if scheme == "iid":
        perm = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed))
        # client c holds perm[c::C]: reorder the permutation so each client's run is contiguous
        owner = torch.arange(num_samples) % clients
        order = torch.argsort(owner, stable=True)
        sizes = torch.bincount(owner, minlength=clients)
        return Partition(perm[order], torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)]))
    if labels is None:
        raise ConfigError("federated.partition", scheme, "iid for data without one class label per sample")
    rng = np.random.default_rng(seed)
    labels_np = labels.numpy()
    if scheme == "dirichlet":
        owners, members_all = [], []
        for label in np.unique(labels_np):
            members = rng.permutation(np.flatnonzero(labels_np == label))
            shares = rng.dirichlet(np.full(clients, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
            # the owner of each member: how many cuts lie at or before its position
            owners.append(np.searchsorted(cuts, np.arange(len(members)), side="right"))
            members_all.append(members)
        owner, member = np.concatenate(owners), np.concatenate(members_all)
        order = np.argsort(owner, kind="stable")  # by client, each client's samples in label-then-draw order
        bounds = np.concatenate([[0], np.cumsum(np.bincount(owner, minlength=clients))])
        parts = [member[order[bounds[c]:bounds[c + 1]]] for c in range(clients)]
    elif scheme == "shards":
        shuffled = rng.permutation(num_samples)
        by_label = shuffled[np.argsort(labels_np[shuffled], kind="stable")]
        shards = np.array_split(by_label, clients * classes_per_client)
        chosen = rng.permutation(len(shards)).reshape(clients, classes_per_client)
        parts = [np.concatenate([shards[s] for s in row]) for row in chosen]
    else:
        raise ConfigError("federated.partition", scheme, "one of iid, dirichlet, shards")
    return Partition.of([rng.permutation(part) for part in parts])


def empty_clients(parts: Partition) -> list[int]:
    """Clients that hold no sample."""
    return torch.nonzero(parts.sizes() == 0).flatten().tolist()


def describe(parts: Partition, labels: torch.Tensor | None) -> dict[str, float]:
    """Sizes of the partition and, with labels, how many classes a client holds on average."""
    sizes = parts.sizes().double()
    summary = {"min_samples": int(sizes.min()), "max_samples": int(sizes.max()), "mean_samples": float(sizes.mean())}
    if labels is not None:
        classes = [len(torch.unique(labels[part])) for part in parts if len(part)]
        summary["mean_classes"] = float(np.mean(classes)) if classes else 0.0
    return summary


def client_partitions(cfg: Any, dataset: Any, seed: int) -> tuple[Partition, torch.Tensor | None]:
    """Each client's sample indices of ``dataset`` (and the labels, where samples have one)."""
    labels = labels_of(dataset) if cfg.partition != "iid" else None
    parts = partition(len(dataset), cfg.clients, cfg.partition, seed, labels, cfg.alpha, cfg.classes_per_client)
    return parts, labels
