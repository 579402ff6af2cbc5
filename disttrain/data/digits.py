"""scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes; ships with scikit-learn)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, default_collate

from disttrain import checks
from disttrain.counter_random import counter_random
from disttrain.data.base import BatchIndices, DataModule, index_tensor
from disttrain.data.registry import DATA
from disttrain.data.spec import DataSpec

IMAGE_SIZE = 8


@dataclass
class DigitsConfig:
    """scikit-learn's ``load_digits``: a fixed, seeded, stratified train/val/test split.

    Pixels are scaled to [0, 1], then normalised by the mean and standard deviation of the training split.
    """

    name: str = "digits"
    """Registry name."""
    split_seed: int = 0
    """Seed of the train/val/test split (independent of the run's seed, so runs compare on one split)."""
    val_fraction: float = 0.1
    """Fraction of all images held out for validation."""
    test_fraction: float = 0.2
    """Fraction of all images held out for the final test."""
    augment: bool = False
    """Shift training images by up to one pixel in each direction, drawn afresh each epoch."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""

    def validate(self) -> None:
        """Fractions in (0, 1) that leave training images."""
        checks.held_out_fractions(self.val_fraction, self.test_fraction, below=0.9)
        checks.non_negative("data.num_workers", self.num_workers)


@cache
def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as (images (1797, 64), labels (1797,)), read once per process and read-only:
    the fork server reads them before it forks ranks (``disttrain.launch.warm_data``), and every data module of a
    process shares them."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    images.flags.writeable = labels.flags.writeable = False
    return images, labels


def digits_split(cfg: DigitsConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{"train"|"val"|"test": (images (N, 1, 8, 8) float32, labels (N,) int64)}``, normalised by train."""
    from sklearn.model_selection import train_test_split

    images, labels = digits_arrays()
    total = len(labels)
    index = np.arange(total)
    rest, test = train_test_split(index, test_size=round(cfg.test_fraction * total), stratify=labels,
                                  random_state=cfg.split_seed)
    train, val = train_test_split(rest, test_size=round(cfg.val_fraction * total), stratify=labels[rest],
                                  random_state=cfg.split_seed)
    pixels = images.astype(np.float64) / 16.0
    mean, std = pixels[train].mean(), pixels[train].std()
    normalised = ((pixels - mean) / std).astype(np.float32).reshape(-1, 1, IMAGE_SIZE, IMAGE_SIZE)
    splits = {"train": np.sort(train), "val": np.sort(val), "test": np.sort(test)}
    return {
        split: (torch.from_numpy(normalised[idx]), torch.from_numpy(labels[idx].astype(np.int64)))
        for split, idx in splits.items()
    }


class ImageDataset(Dataset):
    """Images and labels held in memory, optionally shifted at random by up to ``shift`` pixels.

    With a shift, index ``e * len(self) + i`` is image ``i`` in epoch ``e`` (see ``EpochDistributedSampler``);
    its shift is drawn from ``(seed, e, i)``, the same on every rank and worker. The border is filled with
    ``fill`` (the normalised value of a blank pixel).
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, shift: int = 0, seed: int = 0,
                 fill: float = 0.0) -> None:
        self.images, self.labels, self.shift, self.seed = images, labels, shift, seed
        self.epoch_indexed = shift > 0
        if shift:
            self.padded = F.pad(images, (shift,) * 4, value=fill)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, i = divmod(index, len(self.labels))
        if epoch and not self.shift:
            raise IndexError(index)
        if not self.shift:
            return self.images[i], self.labels[i]
        span = 2 * self.shift + 1
        draw = counter_random(self.seed, epoch, i)
        dy, dx = draw % span, (draw // span) % span
        height, width = self.images.shape[-2:]
        return self.padded[i, :, dy:dy + height, dx:dx + width], self.labels[i]

    def get_batch(self, indices: BatchIndices) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples of ``indices`` stacked, as a DataLoader would collate them (unshifted: one index op per
        tensor, which also rejects an index out of range)."""
        if self.shift:
            return default_collate([self[i] for i in index_tensor(indices).tolist()])
        rows = index_tensor(indices)
        return self.images.index_select(0, rows), self.labels.index_select(0, rows)


@DATA.register("digits", DigitsConfig)
class DigitsDataModule(DataModule):
    """Classification of scikit-learn's 8x8 digits."""

    def __init__(self, cfg: DigitsConfig, micro_batch_size: int, seed: int) -> None:
        super().__init__(micro_batch_size, seed, cfg.num_workers)
        self.cfg = cfg
        self._spec = DataSpec(kind="image", num_classes=10, in_channels=1, image_size=IMAGE_SIZE)

    @property
    def spec(self) -> DataSpec:
        """Images, 10 classes, 1 channel, 8x8."""
        return self._spec

    def _datasets(self) -> dict[str, Dataset]:
        splits = digits_split(self.cfg)
        train_images = splits["train"][0]
        blank = float(train_images.min())  # the normalised value of a zero pixel
        return {
            "train": ImageDataset(*splits["train"], shift=1 if self.cfg.augment else 0, seed=self.seed,
                                  fill=blank),
            "val": ImageDataset(*splits["val"]),
            "test": ImageDataset(*splits["test"]),
        }
