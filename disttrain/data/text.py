"""Text data as next-token windows: Python's own documentation (byte tokens) and nanoGPT-style files."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from omegaconf import MISSING
from torch.utils.data import Dataset

from disttrain import checks
from disttrain.data.base import DataModule
from disttrain.data.registry import DATA
from disttrain.data.spec import DataSpec
from disttrain.data.windows import MemmapTokens, train_val_windows
from disttrain.errors import ConfigError


def pydocs_bytes() -> np.ndarray:
    """The text of Python's documentation topics (sorted by key, joined by blank lines) as UTF-8 bytes."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[key] for key in sorted(topics))
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


@dataclass
class PyDocsConfig:
    """The text of Python's own documentation (``pydoc_data.topics``, shipped with Python) as byte tokens.

    About 466k bytes; the last ``val_fraction`` is validation (and test). Vocabulary 256.
    """

    name: str = "pydocs"
    """Registry name."""
    block_size: int = 64
    """Tokens per sample (the model's context length)."""
    val_fraction: float = 0.1
    """Fraction of the text, taken from its end, held out for validation and test."""
    samples_per_epoch: int | None = None
    """Random training windows per epoch (fresh offsets every epoch). None: training tokens // block_size."""
    val_windows: int | None = None
    """Cap on the consecutive, non-overlapping validation windows. None: all that fit."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""

    TEXT_ENCODING = "utf-8"
    """Its tokens are the bytes of text in this encoding (how a prompt becomes tokens, and tokens text)."""

    def validate(self) -> None:
        """Reject sizes that cannot make a window."""
        checks.positive("data.block_size", self.block_size)
        checks.fraction("data.val_fraction", self.val_fraction)
        checks.positive("data.samples_per_epoch", self.samples_per_epoch, optional=True)
        checks.positive("data.val_windows", self.val_windows, optional=True)
        checks.non_negative("data.num_workers", self.num_workers)
        size = len(pydocs_bytes())
        val = int(size * self.val_fraction)
        if min(val, size - val) < self.block_size + 1:
            raise ConfigError("data.block_size", self.block_size,
                              f"small enough that train ({size - val} bytes) and val ({val} bytes) each "
                              "hold a window plus its target")


@DATA.register("pydocs", PyDocsConfig)
class PyDocsDataModule(DataModule):
    """Byte-level next-token prediction on Python's documentation."""

    def __init__(self, cfg: PyDocsConfig, micro_batch_size: int, seed: int) -> None:
        super().__init__(micro_batch_size, seed, cfg.num_workers)
        self.cfg = cfg
        self._spec = DataSpec(kind="text", vocab_size=256, block_size=cfg.block_size)

    @property
    def spec(self) -> DataSpec:
        """Text, vocabulary 256 (bytes), the configured block size."""
        return self._spec

    def _datasets(self) -> dict[str, Dataset]:
        data = pydocs_bytes()
        split = len(data) - int(len(data) * self.cfg.val_fraction)
        c = self.cfg
        return train_val_windows(data[:split], data[split:], c.block_size, c.samples_per_epoch, c.val_windows,
                        self.seed)


TOKEN_FILES = "expected a directory with train.bin and val.bin (uint16 token ids)"


@dataclass
class TokensConfig:
    """Your own tokenised corpus, nanoGPT style: a directory with ``train.bin`` and ``val.bin``.

    Each file is a flat array of ``uint16`` token ids (``np.array(ids, np.uint16).tofile(...)``). The files
    are memory-mapped, never loaded whole; validation is also the test set.
    """

    name: str = "tokens"
    """Registry name."""
    path: str = MISSING
    """Directory holding train.bin and val.bin."""
    block_size: int = 64
    """Tokens per sample (the model's context length)."""
    vocab_size: int | None = None
    """Number of token ids. None: the largest id in the files + 1, rounded up to a multiple of 64 (a scan)."""
    samples_per_epoch: int | None = None
    """Random training windows per epoch (fresh offsets every epoch). None: training tokens // block_size."""
    val_windows: int | None = None
    """Cap on the consecutive, non-overlapping validation windows. None: all that fit."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""

    def file(self, split: str) -> str:
        """Path of ``train.bin`` or ``val.bin``."""
        return os.path.join(os.path.expanduser(self.path), f"{split}.bin")

    def validate(self) -> list[str]:
        """The directory and both files exist, hold whole uint16 ids, at least one window each, and ids below
        ``vocab_size``; returns a notice when an inferred vocabulary looks inflated."""
        checks.positive("data.block_size", self.block_size)
        checks.positive("data.vocab_size", self.vocab_size, optional=True)
        checks.positive("data.samples_per_epoch", self.samples_per_epoch, optional=True)
        checks.positive("data.val_windows", self.val_windows, optional=True)
        checks.non_negative("data.num_workers", self.num_workers)
        if not os.path.isdir(os.path.expanduser(self.path)):
            raise ConfigError("data.path", self.path, f"no such directory; {TOKEN_FILES}")
        for split in ("train", "val"):
            if not os.path.isfile(self.file(split)):
                raise ConfigError("data.path", self.path, f"no {split}.bin there; {TOKEN_FILES}")
            size = os.path.getsize(self.file(split))
            if size % 2:
                raise ConfigError("data.path", self.path,
                                  f"{split}.bin has an odd number of bytes; {TOKEN_FILES}")
            if size // 2 < self.block_size + 1:
                raise ConfigError("data.path", self.path,
                                  f"{split}.bin holds {size // 2} tokens; each split needs at least "
                                  f"data.block_size + 1 = {self.block_size + 1}")
        return self._check_ids()

    def _check_ids(self) -> list[str]:
        """Every id below a given vocabulary; an inferred vocabulary that a few stray ids inflate is named."""
        files = {split: MemmapTokens(self.file(split)) for split in ("train", "val")}
        if self.vocab_size is not None:
            for split, tokens in files.items():
                stray = tokens.first_at_least(self.vocab_size)
                if stray is not None:
                    raise ConfigError("data.vocab_size", self.vocab_size,
                                      f"more than every token id: {split}.bin holds id {stray[1]} at position "
                                      f"{stray[0]}")
            return []
        counts = sum(tokens.id_counts() for tokens in files.values())
        present = np.flatnonzero(counts)
        largest = int(present.max(initial=0))
        vocab = round_up(largest + 1, 64)
        if vocab > 4 * len(present) + 64:
            return [f"data.vocab_size inferred as {vocab} from the largest id {largest}, but only {len(present)} "
                    "distinct ids occur: set data.vocab_size if that id is a stray"]
        return []


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return -(-value // multiple) * multiple


@DATA.register("tokens", TokensConfig)
class TokensDataModule(DataModule):
    """Next-token prediction on memory-mapped ``train.bin`` / ``val.bin`` token files."""

    def __init__(self, cfg: TokensConfig, micro_batch_size: int, seed: int) -> None:
        super().__init__(micro_batch_size, seed, cfg.num_workers)
        self.cfg = cfg
        self.train_tokens = MemmapTokens(cfg.file("train"))
        self.val_tokens = MemmapTokens(cfg.file("val"))

    @cached_property
    def vocab_size(self) -> int:
        """The configured vocabulary, else the largest id in the files + 1 rounded up to a multiple of 64."""
        if self.cfg.vocab_size is not None:
            return self.cfg.vocab_size
        return round_up(max(self.train_tokens.max(), self.val_tokens.max()) + 1, 64)

    @property
    def spec(self) -> DataSpec:
        """Text, the vocabulary (scanned once when not configured), the configured block size."""
        return DataSpec(kind="text", vocab_size=self.vocab_size, block_size=self.cfg.block_size)

    def _datasets(self) -> dict[str, Dataset]:
        c = self.cfg
        return train_val_windows(self.train_tokens, self.val_tokens, c.block_size, c.samples_per_epoch, c.val_windows,
                        self.seed)
