"""What every data module shares: the spec it reports, per-rank sampling and the loaders built on it.

Sampling is owned here, not by Lightning (the runner passes ``use_distributed_sampler=False``): every
loader shards its data with a ``DistributedSampler`` over the data-parallel ranks, also in a single
process. A training loader with per-rank batch ``B`` on ``R`` ranks gives rank ``r`` the samples
``perm[r::R]`` of the epoch's permutation ``perm``, so one optimiser step sees the same samples whatever
``R`` is, as long as ``B * R`` is the same, and an epoch holds only whole optimiser steps. Evaluation
takes samples in order, rank ``r`` the samples ``r::R``, each counted once.

A training dataset that offers ``get_batch(indices)`` (the in-memory images, the token windows) is read one
micro-batch per call: the loader's sampler yields the same indices grouped into batches (one tensor each), and
the dataset indexes them at once instead of fetching and stacking sample by sample (cheaper on this path
(benchmarks/README.md, Figures cited elsewhere)). The batches are the same tensors, in the same order.
"""

from __future__ import annotations

import itertools
from abc import abstractmethod
from collections.abc import Iterator, Sequence
from functools import cached_property
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler, Sampler, TensorDataset

from disttrain.data.position import epoch_position, skip_per_rank
from disttrain.data.spec import DataSpec
from disttrain.errors import ConfigError

IGNORE_INDEX = -100
"""Target of an evaluation sample that only pads a rank's share (skipped by the loss and the metrics)."""

BatchIndices = torch.Tensor | Sequence[int]
"""The samples of one micro-batch read by a dataset's ``get_batch``: a 1-D integer tensor (what ``BatchReader``
passes) or a sequence of ints."""


def index_tensor(indices: BatchIndices) -> torch.Tensor:
    """``indices`` as a 1-D int64 tensor (a tensor passes unchanged). Read with ``index_select``, which rejects
    negative and too-large indices alike with an ``IndexError``, and copies rows faster than ``tensor[rows]``
    (benchmarks/README.md, Figures cited elsewhere)."""
    return torch.as_tensor(indices, dtype=torch.long)


class EpochDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` whose indices also carry the epoch: ``epoch * len(dataset) + i``.

    For datasets that draw fresh samples every epoch (random text windows, augmented images): they read
    index ``e * n + i`` as sample ``i`` of epoch ``e``. Which ``i`` a rank gets is exactly what the plain
    ``DistributedSampler`` gives it; Lightning sets the epoch through ``set_epoch`` as for any sampler.
    """

    def __iter__(self) -> Iterator[int]:
        base = self.epoch * len(self.dataset)  # type: ignore[arg-type]
        return (base + int(i) for i in super().__iter__())


class StepSampler(Sampler[int]):
    """Wraps a training sampler: whole optimiser steps only, and in a resumed epoch the samples not yet seen.

    An epoch ends at its last complete global batch (``samples_per_step`` samples per rank: micro-batch x
    accumulation), so accumulating over 4 micro-batches gives the same steps as one batch 4 times larger,
    and no step averages fewer micro-batches than the others. Lightning restores a mid-epoch checkpoint by
    starting the epoch's loader afresh; skipping ``skip`` samples in epoch ``resume_epoch`` makes the
    resumed run see exactly the batches it would have seen without the interruption.
    """

    def __init__(self, sampler: DistributedSampler, samples_per_step: int, resume_epoch: int = -1,
                 skip: int = 0) -> None:
        self.sampler, self.samples_per_step = sampler, samples_per_step
        self.resume_epoch, self.skip = resume_epoch, skip

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the wrapped sampler (Lightning calls it before each epoch)."""
        self.sampler.set_epoch(epoch)

    def _skipped(self) -> int:
        return self.skip if self.sampler.epoch == self.resume_epoch else 0

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.sampler), self._skipped(), len(self))

    def __len__(self) -> int:
        # The full epoch's length also when resuming: Lightning sizes the epoch before it sets the epoch
        # number, and the resumed epoch simply ends early when the iterator runs out.
        return len(self.sampler) // self.samples_per_step * self.samples_per_step


class MaskedPadding(Dataset):
    """An evaluation dataset padded to ``length`` samples; padding repeats samples with ignored targets.

    Every data-parallel rank must run the same number of full batches (sharded and pipelined models
    communicate inside forward), yet each sample must count once: padded samples carry the target
    ``IGNORE_INDEX`` everywhere, which the loss and the metrics skip.
    """

    def __init__(self, dataset: Dataset, length: int) -> None:
        self.dataset, self.length, self.real = dataset, length, len(dataset)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        if index < self.real:
            return self.dataset[index]
        inputs, targets, *rest = self.dataset[index % self.real]  # rest: e.g. each target's source
        return inputs, torch.full_like(torch.as_tensor(targets), IGNORE_INDEX), *rest


class BatchedSampler(BatchSampler):
    """A training sampler's indices grouped into micro-batches, for datasets read a batch per call; forwards
    ``set_epoch`` to the sampler (Lightning calls it on a loader's ``sampler`` before each epoch)."""

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the wrapped sampler."""
        self.sampler.set_epoch(epoch)  # type: ignore[attr-defined]

    def index_tensors(self) -> Iterator[torch.Tensor]:
        """This epoch's micro-batches, each as one int64 tensor of indices: the epoch's indices converted at once,
        then split into views (a view costs far less than converting a list of indices per batch). A generator,
        so the indices are drawn when the first batch is read, not when the iterator is made, as a ``BatchSampler``
        draws them: Lightning makes a loader's iterator (``setup_data``) before it sets the sampler's epoch. Drawn
        eagerly, a run resumed at an epoch's end trained no batch in the next epoch (``test_pipeline_run``)."""
        order = torch.tensor(list(self.sampler), dtype=torch.long)
        batches = order.split(self.batch_size)
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches = batches[:-1]
        yield from batches


class WholeBatches(Dataset):
    """A dataset indexed by a list of indices (one micro-batch), answered by its ``get_batch``: the lists a
    DataLoader's sampler hands its workers (tensors would each travel through a shared-memory file)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, indices: list[int]) -> Any:
        return self.dataset.get_batch(indices)  # type: ignore[attr-defined]


class BatchReader:
    """The training batches of a dataset read one micro-batch per call (``get_batch``, which returns tensors), in
    the order of a sampler of whole batches: what a DataLoader without workers or pinning yields from them.

    The DataLoader's own work per batch (a profiler record, its index and fetch steps, converting the tensors to
    tensors) cost more than the dataset's own read of GPT micro's batch, with cold caches between reads, and a
    new iterator each epoch (benchmarks/README.md, Figures cited elsewhere). Lightning sets the epoch on ``sampler``.
    """

    def __init__(self, dataset: Dataset, sampler: BatchedSampler) -> None:
        self.dataset = dataset
        self.sampler = sampler
        """The micro-batches' indices, epoch by epoch."""

    def __iter__(self) -> Iterator[Any]:
        return map(self.dataset.get_batch, self.sampler.index_tensors())  # type: ignore[attr-defined]

    def __len__(self) -> int:
        return len(self.sampler)


class InMemoryTensors(TensorDataset):
    """A ``TensorDataset`` that is also read a micro-batch per call."""

    def get_batch(self, indices: BatchIndices) -> tuple[torch.Tensor, ...]:
        """The samples of ``indices`` stacked, as a DataLoader would collate them."""
        rows = index_tensor(indices)
        return tuple(tensor.index_select(0, rows) for tensor in self.tensors)


class DataModule:
    """Base of the registered data modules: Lightning's data module hooks (``setup``, the three loaders,
    ``state_dict``), without Lightning, so that the job process validates a config without importing it; the
    ranks hand it to Lightning's Trainer as ``disttrain.rank.lightning_data.LightningData``.

    Subclasses set ``spec`` (a ``DataSpec``, available right after construction), ``num_train_samples``
    (samples per training epoch over all ranks) and build their splits in ``_datasets()``, which returns
    ``{"train": ..., "val": ..., "test": ...}`` and is called at most once.
    """

    def __init__(self, micro_batch_size: int, seed: int, num_workers: int = 0) -> None:
        self.trainer: Any = None
        """The Lightning Trainer this module's loaders feed, once it is attached (its ranks and training position);
        None before, and in the job process."""
        if micro_batch_size < 1:
            raise ConfigError("batch.micro_size", micro_batch_size, "a positive number of samples per rank")
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.num_workers = num_workers
        self._resume: dict[str, int] = {}
        self.accumulation = 1
        """Micro-batches per optimiser step on each rank; a training epoch ends at its last whole step."""
        self.full_eval_batches = False
        """Pad evaluation to whole batches on every rank (pipeline stages need one batch shape throughout)."""

    def state_dict(self) -> dict[str, int]:
        """Where training stands within the epoch, in global samples (``disttrain.data.position``); saved with
        every checkpoint."""
        trainer: Any = getattr(self, "trainer", None)
        if trainer is None:
            return {}
        batches = trainer.fit_loop.epoch_loop.batch_progress.current.processed
        return epoch_position(trainer.current_epoch, batches, self.micro_batch_size, self.accumulation,
                              self.replicas(train=True)[0])

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Remember the position so the next training loader continues after the samples already seen, on
        however many data-parallel ranks it runs."""
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

    def replicas(self, train: bool = False) -> tuple[int, int]:
        """``(num_replicas, rank)`` of data parallelism: from the attached trainer, else ``(1, 0)``; ``train``: of
        the training data (replica groups split it between them, see ``DistTrainStrategy.train_sampler_kwargs``)."""
        trainer: Any = getattr(self, "trainer", None)
        strategy = getattr(trainer, "strategy", None) if trainer is not None else None
        if train and hasattr(strategy, "train_sampler_kwargs"):
            kwargs = strategy.train_sampler_kwargs  # type: ignore[union-attr]
            return int(kwargs["num_replicas"]), int(kwargs["rank"])
        kwargs = getattr(trainer, "distributed_sampler_kwargs", None) if trainer is not None else None
        if not kwargs:
            return 1, 0
        return int(kwargs["num_replicas"]), int(kwargs["rank"])

    def _loader(self, dataset: Dataset, train: bool) -> DataLoader | BatchReader:
        num_replicas, rank = self.replicas(train)
        if train:
            sampler_cls = EpochDistributedSampler if getattr(dataset, "epoch_indexed", False) else DistributedSampler
            inner = sampler_cls(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=self.seed,
                                drop_last=True)
            resume = (self._resume["epoch"], skip_per_rank(self._resume, self.micro_batch_size, num_replicas)) \
                if self._resume else (-1, 0)
            sampler: Sampler[int] = StepSampler(inner, self.micro_batch_size * self.accumulation, *resume)
            if hasattr(dataset, "get_batch"):
                return self._batched_loader(dataset, sampler)
        else:
            multiple = num_replicas * (self.micro_batch_size if self.full_eval_batches else 1)
            dataset = MaskedPadding(dataset, -(-len(dataset) // multiple) * multiple)  # type: ignore[arg-type]
            sampler = DistributedSampler(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
        return DataLoader(
            dataset,
            batch_size=self.micro_batch_size,
            sampler=sampler,
            drop_last=train,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
            # a loader of its own generator draws nothing from the global one that dropout uses, so a run
            # resumed mid-epoch continues the same dropout masks as the uninterrupted run
            generator=torch.Generator().manual_seed(self.seed),
        )

    def _batched_loader(self, dataset: Dataset, sampler: Sampler[int]) -> DataLoader | BatchReader:
        """The training loader of a dataset read one micro-batch per call (same batches as ``_loader``'s): a
        ``BatchReader`` where a DataLoader would have no workers to run and no memory to pin."""
        batches = BatchedSampler(sampler, self.micro_batch_size, drop_last=True)
        pin_memory = torch.cuda.is_available()
        if self.num_workers == 0 and not pin_memory:
            return BatchReader(dataset, batches)
        return DataLoader(
            WholeBatches(dataset),
            batch_size=None,  # the sampler yields whole batches
            sampler=batches,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=pin_memory,
            generator=torch.Generator().manual_seed(self.seed),
        )

    def train_dataloader(self) -> DataLoader | BatchReader:
        """Shuffled, sharded over the data-parallel ranks, incomplete batches dropped."""
        return self._loader(self.datasets["train"], train=True)

    def val_dataloader(self) -> DataLoader:
        """In order, sharded over the data-parallel ranks; each sample counts once (see ``MaskedPadding``)."""
        return self._loader(self.datasets["val"], train=False)

    def test_dataloader(self) -> DataLoader:
        """In order, sharded like validation."""
        return self._loader(self.datasets["test"], train=False)
