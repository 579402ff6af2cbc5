"""What every data module shares: the spec it reports, per-rank sampling and the loaders built on it.

Sampling is owned here, not by Lightning (the runner passes ``use_distributed_sampler=False``): every
loader shards its data with a ``DistributedSampler`` over the data-parallel ranks, also in a single
process. A training loader with per-rank batch ``B`` on ``R`` ranks gives rank ``r`` the samples
``perm[r::R]`` of the epoch's permutation ``perm``, so one optimiser step sees the same samples whatever
``R`` is, as long as ``B * R`` is the same.
"""

from __future__ import annotations

import itertools
from abc import abstractmethod
from collections.abc import Iterator
from functools import cached_property
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler

from disttrain.errors import ConfigError
from disttrain.models.spec import DataSpec

_MASK64 = (1 << 64) - 1


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


class EpochDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` whose indices also carry the epoch: ``epoch * len(dataset) + i``.

    For datasets that draw fresh samples every epoch (random text windows, augmented images): they read
    index ``e * n + i`` as sample ``i`` of epoch ``e``. Which ``i`` a rank gets is exactly what the plain
    ``DistributedSampler`` gives it; Lightning sets the epoch through ``set_epoch`` as for any sampler.
    """

    def __iter__(self) -> Iterator[int]:
        base = self.epoch * len(self.dataset)  # type: ignore[arg-type]
        return (base + int(i) for i in super().__iter__())


class ResumeSampler(Sampler[int]):
    """Wraps a training sampler; in the epoch a checkpoint was taken, it skips the samples already seen.

    Lightning restores a mid-epoch checkpoint by starting the epoch's loader afresh; skipping here makes
    the resumed run see exactly the batches it would have seen without the interruption.
    """

    def __init__(self, sampler: DistributedSampler, epoch: int, skip: int) -> None:
        self.sampler, self.resume_epoch, self.skip = sampler, epoch, skip

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the wrapped sampler (Lightning calls it before each epoch)."""
        self.sampler.set_epoch(epoch)

    def _skipped(self) -> int:
        return self.skip if self.sampler.epoch == self.resume_epoch else 0

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.sampler), self._skipped(), None)

    def __len__(self) -> int:
        # The full length: Lightning sizes the epoch before it sets the epoch number, and the resumed epoch
        # simply ends early when the iterator runs out.
        return len(self.sampler)


class DataModule(pl.LightningDataModule):
    """Base of the registered data modules.

    Subclasses set ``spec`` (a ``DataSpec``, available right after construction), ``num_train_samples``
    (samples per training epoch over all ranks) and build their splits in ``_datasets()``, which returns
    ``{"train": ..., "val": ..., "test": ...}`` and is called at most once.
    """

    def __init__(self, micro_batch_size: int, seed: int, num_workers: int = 0) -> None:
        super().__init__()
        if micro_batch_size < 1:
            raise ConfigError("batch.micro_size", micro_batch_size, "a positive number of samples per rank")
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.num_workers = num_workers
        self._resume: dict[str, int] = {}
        self.full_eval_batches = False
        """Drop a smaller last validation/test batch (pipeline stages need one batch shape throughout)."""

    def state_dict(self) -> dict[str, int]:
        """Where training stands within the epoch; saved with every checkpoint."""
        trainer: Any = getattr(self, "trainer", None)
        if trainer is None:
            return {}
        batches = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return {"epoch": trainer.current_epoch, "batches": batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Remember the position so the next training loader continues after the batches already seen."""
        self._resume = dict(state)

    @property
    @abstractmethod
    def spec(self) -> DataSpec:
        """What the model must fit: kind, classes or vocabulary, sizes (each data module defines it)."""

    @property
    def num_train_samples(self) -> int:
        """Training samples per epoch, over all ranks."""
        return len(self.datasets["train"])

    @abstractmethod
    def _datasets(self) -> dict[str, Dataset]:
        """The train, val and test datasets (each data module builds its own)."""

    @cached_property
    def datasets(self) -> dict[str, Dataset]:
        """The train, val and test datasets, built on first use."""
        return self._datasets()

    def setup(self, stage: str | None = None) -> None:
        """Build the splits (once; later calls are free)."""
        _ = self.datasets

    def replicas(self) -> tuple[int, int]:
        """``(num_replicas, rank)`` of data parallelism: from the attached trainer, else ``(1, 0)``."""
        trainer: Any = getattr(self, "trainer", None)
        kwargs = getattr(trainer, "distributed_sampler_kwargs", None) if trainer is not None else None
        if not kwargs:
            return 1, 0
        return int(kwargs["num_replicas"]), int(kwargs["rank"])

    def _loader(self, dataset: Dataset, train: bool) -> DataLoader:
        num_replicas, rank = self.replicas()
        epoch_indexed = getattr(dataset, "epoch_indexed", False)
        sampler_cls = EpochDistributedSampler if epoch_indexed else DistributedSampler
        sampler = sampler_cls(
            dataset, num_replicas=num_replicas, rank=rank, shuffle=train, seed=self.seed, drop_last=train
        )
        if train and self._resume:
            skip = self._resume["batches"] * self.micro_batch_size
            sampler = ResumeSampler(sampler, self._resume["epoch"], skip)
        return DataLoader(
            dataset,
            batch_size=self.micro_batch_size,
            sampler=sampler,
            drop_last=train or self.full_eval_batches,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled, sharded over the data-parallel ranks, incomplete batches dropped."""
        return self._loader(self.datasets["train"], train=True)

    def val_dataloader(self) -> DataLoader:
        """In order, sharded over the data-parallel ranks (the last shard is padded to equal length)."""
        return self._loader(self.datasets["val"], train=False)

    def test_dataloader(self) -> DataLoader:
        """In order, sharded like validation."""
        return self._loader(self.datasets["test"], train=False)


def check_positive(key: str, value: int | float | None, optional: bool = False) -> None:
    """ConfigError unless ``value`` > 0 (or None when ``optional``)."""
    if value is None and optional:
        return
    if value is None or value <= 0:
        raise ConfigError(key, value, "a positive number" + (", or null" if optional else ""))


def check_non_negative(key: str, value: int) -> None:
    """ConfigError unless ``value`` >= 0."""
    if value < 0:
        raise ConfigError(key, value, "zero or a positive number")


def check_fraction(key: str, value: float) -> None:
    """ConfigError unless 0 < ``value`` < 1."""
    if not 0.0 < value < 1.0:
        raise ConfigError(key, value, "a fraction strictly between 0 and 1")
