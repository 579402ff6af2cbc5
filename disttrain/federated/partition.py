"""Dividing a training split among clients: iid, Dirichlet over labels, or label-sorted shards.

Every partition is a function of the run's seed alone, so each rank computes the same one without
communication. The iid partition of ``C`` clients is the first epoch of a ``DistributedSampler`` over ``C``
replicas (client ``c`` holds ``perm[c::C]`` of the seeded permutation), so FedAvg with one client per rank
sees the samples that data parallelism gives the ranks in their first epoch.
"""

from __future__ import annotations

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


def partition(num_samples: int, clients: int, scheme: str, seed: int, labels: torch.Tensor | None = None,
              alpha: float = 0.5, classes_per_client: int = 2) -> list[torch.Tensor]:
    """Sample indices of each client, in the order the client reads them in its first local epoch."""
    if scheme == "iid":
        perm = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed))
        return [perm[client::clients] for client in range(clients)]
    if labels is None:
        raise ConfigError("federated.partition", scheme, "iid for data without one class label per sample")
    rng = np.random.default_rng(seed)
    labels_np = labels.numpy()
    if scheme == "dirichlet":
        owned: list[list[int]] = [[] for _ in range(clients)]
        for label in np.unique(labels_np):
            members = rng.permutation(np.flatnonzero(labels_np == label))
            shares = rng.dirichlet(np.full(clients, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(members)).astype(int)
            for client, part in enumerate(np.split(members, cuts)):
                owned[client].extend(part.tolist())
        parts = [np.asarray(indices, dtype=np.int64) for indices in owned]
    elif scheme == "shards":
        shuffled = rng.permutation(num_samples)
        by_label = shuffled[np.argsort(labels_np[shuffled], kind="stable")]
        shards = np.array_split(by_label, clients * classes_per_client)
        chosen = rng.permutation(len(shards)).reshape(clients, classes_per_client)
        parts = [np.concatenate([shards[s] for s in row]) for row in chosen]
    else:
        raise ConfigError("federated.partition", scheme, "one of iid, dirichlet, shards")
    return [torch.from_numpy(rng.permutation(part)) for part in parts]


def empty_clients(parts: list[torch.Tensor]) -> list[int]:
    """Clients that hold no sample."""
    return [client for client, part in enumerate(parts) if len(part) == 0]


def describe(parts: list[torch.Tensor], labels: torch.Tensor | None) -> dict[str, float]:
    """Sizes of the partition and, with labels, how many classes a client holds on average."""
    sizes = torch.tensor([len(part) for part in parts], dtype=torch.float64)
    summary = {"min_samples": int(sizes.min()), "max_samples": int(sizes.max()), "mean_samples": float(sizes.mean())}
    if labels is not None:
        classes = [len(torch.unique(labels[part])) for part in parts if len(part)]
        summary["mean_classes"] = float(np.mean(classes)) if classes else 0.0
    return summary


def client_partitions(cfg: Any, dataset: Any, seed: int) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Each client's sample indices of ``dataset`` (and the labels, where samples have one)."""
    labels = labels_of(dataset) if cfg.partition != "iid" else None
    parts = partition(len(dataset), cfg.clients, cfg.partition, seed, labels, cfg.alpha, cfg.classes_per_client)
    return parts, labels
