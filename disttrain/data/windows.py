"""Next-token windows over a 1-D array of token ids, shared by every text data module."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from disttrain.counter_random import counter_random, counter_random_array
from disttrain.data.base import BatchIndices, index_tensor


class MemmapTokens:
    """A 1-D token file (``uint16`` unless ``dtype`` says otherwise) read through a memory map that is opened
    on first access; ``start`` and ``length`` (in tokens) select a stretch of it, e.g. one split.

    Only the path travels when a loader pickles the dataset to its workers; each process maps the file
    itself. Supports ``len`` and slicing, which is all ``TokenWindows`` needs.
    """

    def __init__(self, path: str | os.PathLike[str], dtype: np.dtype | type = np.uint16, start: int = 0,
                 length: int | None = None) -> None:
        self.path = os.fspath(path)
        self.dtype = np.dtype(dtype)
        self.start = start
        self._length = os.path.getsize(self.path) // self.dtype.itemsize - start if length is None else length
        self._array: np.memmap | None = None

    def __len__(self) -> int:
        return self._length

    @property
    def array(self) -> np.memmap:
        """The memory map, opened read-only on first use in this process."""
        if self._array is None:
            self._array = np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.start * self.dtype.itemsize,
                                    shape=(self._length,))
        return self._array

    def __getitem__(self, index: Any) -> Any:
        return self.array[index]

    def max(self, chunk: int = 1 << 24) -> int:
        """The largest token id, scanned in chunks (reads the whole file once)."""
        return self.id_counts(chunk).nonzero()[0].max(initial=0).item()

    def id_counts(self, chunk: int = 1 << 24) -> np.ndarray:
        """How often each of the 65536 possible ids occurs, counted in chunks (reads the whole file once)."""
        counts = np.zeros(1 << 16, dtype=np.int64)
        for start in range(0, self._length, chunk):
            counts += np.bincount(self.array[start:start + chunk], minlength=1 << 16)
        return counts

    def first_at_least(self, threshold: int, chunk: int = 1 << 24) -> tuple[int, int] | None:
        """``(position, id)`` of the first id >= ``threshold``, or None."""
        if threshold > np.iinfo(self.dtype).max:
            return None
        for start in range(0, self._length, chunk):
            hits = np.flatnonzero(self.array[start:start + chunk] >= threshold)
            if hits.size:
                return start + int(hits[0]), int(self.array[start + hits[0]])
        return None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_array": None}


DRAWN_PER_EPOCH = 1 << 20
"""Epochs of at most this many random windows have their offsets drawn at once (8 MB of offsets at most)."""


class TokenWindows(Dataset):
    """Windows of ``block_size`` tokens and their next-token targets: ``(data[o:o+T], data[o+1:o+T+1])``.

    With a ``seed``, sample ``k`` sits at a random offset, uniform over all valid ones and drawn fresh
    each epoch from ``(seed, epoch, k)``; index ``e * len(self) + k`` means sample ``k`` of epoch ``e``
    (see ``EpochDistributedSampler``), and a plain index ``k`` is epoch 0. ``num_windows`` (default
    ``len(data) // block_size``) defines the epoch.

    Without a seed, the windows are the non-overlapping consecutive ones at offsets ``0, T, 2T, ...``
    (at most ``num_windows`` of them): deterministic evaluation.

    ``data`` is any 1-D integer sequence that supports ``len`` and slicing (a numpy array, a
    ``MemmapTokens``).
    """

    def __init__(self, data: Any, block_size: int, num_windows: int | None = None, seed: int | None = None):
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if len(data) < block_size + 1:
            raise ValueError(f"{len(data)} tokens cannot fill one window of {block_size} plus its target")
        self.data = data
        self.block_size = block_size
        self.seed = seed
        self.epoch_indexed = seed is not None
        if seed is None:
            most = (len(data) - 1) // block_size
            self.num_windows = most if num_windows is None else min(num_windows, most)
        else:
            self.num_windows = len(data) // block_size if num_windows is None else num_windows
        if self.num_windows < 1:
            raise ValueError(f"num_windows must be positive, got {self.num_windows}")
        self._drawn: tuple[int, np.ndarray] | None = None
        """The last epoch whose offsets were all drawn, and those offsets (``epoch_offsets``)."""
        self._window_rows: np.ndarray | None = None
        """Every window of an in-memory ``data`` as a row of a read-only strided view (``get_batch``)."""

    def __getstate__(self) -> dict[str, Any]:
        # a loader worker draws and views for itself: the view would pickle as a copy of every window
        return {**self.__dict__, "_drawn": None, "_window_rows": None}

    def __len__(self) -> int:
        return self.num_windows

    def offset(self, index: int) -> int:
        """Where the window of ``index`` starts in ``data``."""
        if index < 0:
            raise IndexError(index)
        epoch, k = divmod(index, self.num_windows)
        if self.seed is None:
            if epoch:
                raise IndexError(index)
            return k * self.block_size
        return counter_random(self.seed, epoch, k) % (len(self.data) - self.block_size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.offset(index)
        chunk = torch.from_numpy(np.asarray(self.data[start:start + self.block_size + 1], dtype=np.int64))
        return chunk[:-1], chunk[1:]

    def offsets(self, indices: BatchIndices) -> np.ndarray:
        """``offset`` of each of ``indices``, as one array (random windows: drawn together, see
        ``counter_random_array``)."""
        indices = index_tensor(indices).numpy()  # a view of the tensor's memory: no copy
        if self.seed is None or not len(indices):
            return np.fromiter(map(self.offset, indices.tolist()), dtype=np.int64, count=len(indices))
        lowest, highest = int(indices.min()), int(indices.max())
        if lowest < 0:
            raise IndexError(lowest)
        epoch = lowest // self.num_windows
        if self.num_windows <= DRAWN_PER_EPOCH and highest // self.num_windows == epoch:
            # few array operations: each costs tens of microseconds between a step's passes, its caches cold
            first = epoch * self.num_windows
            return self.epoch_offsets(epoch)[indices - first if first else indices]
        epochs, ks = np.divmod(indices, self.num_windows)
        return self._draw(epochs, ks)

    def epoch_offsets(self, epoch: int) -> np.ndarray:
        """Every window's offset in ``epoch``, drawn at once and kept until another epoch is asked for: a batch
        then reads its offsets with one index, much cheaper than drawing them per batch where a step's passes
        leave the caches cold (benchmarks/README.md, Figures cited elsewhere)."""
        if self._drawn is None or self._drawn[0] != epoch:
            every = np.arange(self.num_windows, dtype=np.int64)
            self._drawn = (epoch, self._draw(np.full_like(every, epoch), every))
        return self._drawn[1]

    def _draw(self, epochs: np.ndarray, ks: np.ndarray) -> np.ndarray:
        draws = counter_random_array(self.seed, epochs, ks)
        return (draws % np.uint64(len(self.data) - self.block_size)).astype(np.int64)

    def get_batch(self, indices: BatchIndices) -> tuple[torch.Tensor, torch.Tensor]:
        """The windows of ``indices`` stacked, as a DataLoader would collate them (one gather from the tokens)."""
        offsets = self.offsets(indices)
        if isinstance(self.data, np.ndarray):  # every window is a row of one strided view: no index arithmetic
            if self._window_rows is None:
                self._window_rows = np.lib.stride_tricks.sliding_window_view(self.data, self.block_size + 1)
            rows = self._window_rows[offsets]
        else:
            rows = self.data[offsets[:, None] + np.arange(self.block_size + 1)]
        # each side converted straight from the gathered rows into its own contiguous array
        return torch.from_numpy(rows[:, :-1].astype(np.int64)), torch.from_numpy(rows[:, 1:].astype(np.int64))


def train_val_windows(train: Any, val: Any, block_size: int, samples_per_epoch: int | None,
                      val_windows: int | None, seed: int) -> dict[str, Dataset]:
    """Random training windows and consecutive validation windows; test is the validation set."""
    evaluation = TokenWindows(val, block_size, val_windows)
    return {"train": TokenWindows(train, block_size, samples_per_epoch, seed=seed), "val": evaluation,
            "test": evaluation}
