"""Random data of a chosen shape, for throughput benchmarks only: there is nothing in it to learn."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

from disttrain import checks
from disttrain.data.base import DataModule, InMemoryTensors
from disttrain.data.registry import DATA
from disttrain.data.spec import DataSpec


@dataclass
class SyntheticImagesConfig:
    """Random images with random labels, generated from the run's seed. For throughput benchmarks only."""

    name: str = "synthetic_images"
    """Registry name."""
    num_samples: int = 4096
    """Training images per epoch."""
    val_samples: int = 512
    """Validation (and test) images."""
    image_size: int = 32
    """Side length of the square images."""
    channels: int = 3
    """Channels per image."""
    num_classes: int = 10
    """Number of label classes."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""

    def validate(self) -> None:
        """Positive sizes."""
        for key in ("num_samples", "val_samples", "image_size", "channels", "num_classes"):
            checks.positive(f"data.{key}", getattr(self, key))
        checks.non_negative("data.num_workers", self.num_workers)


@DATA.register("synthetic_images", SyntheticImagesConfig)
class SyntheticImagesDataModule(DataModule):
    """Random ``(channels, image_size, image_size)`` float32 images and int64 labels (benchmarks only)."""

    def __init__(self, cfg: SyntheticImagesConfig, micro_batch_size: int, seed: int) -> None:
        super().__init__(micro_batch_size, seed, cfg.num_workers)
        self.cfg = cfg
        self._spec = DataSpec(kind="image", num_classes=cfg.num_classes, in_channels=cfg.channels,
                              image_size=cfg.image_size)

    @property
    def spec(self) -> DataSpec:
        """Images of the configured shape and classes."""
        return self._spec

    @property
    def num_train_samples(self) -> int:
        """``num_samples``."""
        return self.cfg.num_samples

    def _datasets(self) -> dict[str, Dataset]:
        c = self.cfg
        generator = torch.Generator().manual_seed(self.seed)

        def make(n: int) -> InMemoryTensors:
            images = torch.randn(n, c.channels, c.image_size, c.image_size, generator=generator)
            return InMemoryTensors(images, torch.randint(0, c.num_classes, (n,), generator=generator))

        train, val = make(c.num_samples), make(c.val_samples)
        return {"train": train, "val": val, "test": val}


@dataclass
class SyntheticTokensConfig:
    """Random token sequences generated from the run's seed. For throughput benchmarks only."""

    name: str = "synthetic_tokens"
    """Registry name."""
    num_samples: int = 4096
    """Training sequences per epoch."""
    val_samples: int = 256
    """Validation (and test) sequences."""
    vocab_size: int = 50304
    """Token ids are drawn uniformly from [0, vocab_size)."""
    block_size: int = 256
    """Tokens per sequence."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""

    def validate(self) -> None:
        """Positive sizes."""
        for key in ("num_samples", "val_samples", "vocab_size", "block_size"):
            checks.positive(f"data.{key}", getattr(self, key))
        checks.non_negative("data.num_workers", self.num_workers)


@DATA.register("synthetic_tokens", SyntheticTokensConfig)
class SyntheticTokensDataModule(DataModule):
    """Random ``(block_size,)`` int64 inputs with their next-token targets (benchmarks only)."""

    def __init__(self, cfg: SyntheticTokensConfig, micro_batch_size: int, seed: int) -> None:
        super().__init__(micro_batch_size, seed, cfg.num_workers)
        self.cfg = cfg
        self._spec = DataSpec(kind="text", vocab_size=cfg.vocab_size, block_size=cfg.block_size)

    @property
    def spec(self) -> DataSpec:
        """Text with the configured vocabulary and block size."""
        return self._spec

    @property
    def num_train_samples(self) -> int:
        """``num_samples``."""
        return self.cfg.num_samples

    def _datasets(self) -> dict[str, Dataset]:
        c = self.cfg
        generator = torch.Generator().manual_seed(self.seed)

        def make(n: int) -> InMemoryTensors:
            tokens = torch.randint(0, c.vocab_size, (n, c.block_size + 1), generator=generator)
            return InMemoryTensors(tokens[:, :-1], tokens[:, 1:])

        train, val = make(c.num_samples), make(c.val_samples)
        return {"train": train, "val": val, "test": val}
