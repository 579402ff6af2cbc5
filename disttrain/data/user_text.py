"""Your own text files as next-token windows, tokenised with your Hugging Face tokenizer (``data=text``)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from omegaconf import MISSING
from torch.utils.data import Dataset

from disttrain import checks
from disttrain.data.base import DataModule
from disttrain.data.documents import check_files
from disttrain.data.registry import DATA
from disttrain.data.spec import DataSpec
from disttrain.data.token_cache import DEFAULT_CACHE, TextSources, TokenCache, ensure_token_cache
from disttrain.data.windows import train_val_windows
from disttrain.errors import ConfigError


@dataclass
class TextConfig:
    """Your ``.txt`` files (each one document) and ``.jsonl`` files (one document per line, its text under
    ``text_key``), tokenised once with the tokenizer saved in ``tokenizer`` (a folder with ``tokenizer.json``).

    Documents are joined by the tokenizer's end-of-text token where it has one. The ids are cached under
    ``cache_dir`` and memory-mapped by every rank; the last ``val_fraction`` of them is validation (and test).
    The vocabulary is the tokenizer's.
    """

    name: str = "text"
    """Registry name."""
    files: list[str] = MISSING
    """The .txt and .jsonl files, in the order their tokens are joined."""
    tokenizer: str = MISSING
    """Folder holding a Hugging Face ``tokenizer.json`` (and optionally ``tokenizer_config.json``)."""
    text_key: str = "text"
    """Key of each .jsonl line's text."""
    eos_token: str | None = None
    """Token placed between documents. None: ``tokenizer_config.json``'s eos_token, else the first of
    <|endoftext|>, </s>, <eos>, <|end_of_text|> that is a special token of the tokenizer, else none."""
    cache_dir: str | None = None
    """Folder of the token caches (one subfolder per set of files and tokenizer). None: ``.disttrain-tokens``
    beside the first file."""
    block_size: int = 64
    """Tokens per sample (the model's context length)."""
    val_fraction: float = 0.1
    """Fraction of the tokens, taken from the end, held out for validation and test."""
    samples_per_epoch: int | None = None
    """Random training windows per epoch (fresh offsets every epoch). None: training tokens // block_size."""
    val_windows: int | None = None
    """Cap on the consecutive, non-overlapping validation windows. None: all that fit."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""

    def sources(self) -> TextSources:
        """The files, tokenizer and cache folder, as absolute paths; ConfigError for a bad file list."""
        files = check_files(self.files)
        cache_dir = self.cache_dir if self.cache_dir is not None else os.path.join(os.path.dirname(files[0]),
                                                                                   DEFAULT_CACHE)
        return TextSources(tuple(files), os.path.abspath(os.path.expanduser(self.tokenizer)), self.text_key,
                           self.eos_token, os.path.abspath(os.path.expanduser(cache_dir)))

    def token_cache(self) -> tuple[TokenCache, bool]:
        """The token cache of these files and tokenizer, built on first use; and whether this call built it."""
        return ensure_token_cache(self.sources())

    def split(self, num_tokens: int) -> int:
        """Where validation starts: the last ``val_fraction`` of ``num_tokens`` is held out."""
        return num_tokens - int(num_tokens * self.val_fraction)

    def validate(self) -> list[str]:
        """Check the sizes, the files and the tokenizer, build the token cache if it is missing (here, in the
        job process, before any rank starts) and check that each split fills a window; a notice when built."""
        checks.positive("data.block_size", self.block_size)
        checks.fraction("data.val_fraction", self.val_fraction)
        checks.positive("data.samples_per_epoch", self.samples_per_epoch, optional=True)
        checks.positive("data.val_windows", self.val_windows, optional=True)
        checks.non_negative("data.num_workers", self.num_workers)
        if not self.text_key:
            raise ConfigError("data.text_key", self.text_key, "the key of each .jsonl line's text")
        cache, built = self.token_cache()
        train = self.split(cache.num_tokens)
        if min(train, cache.num_tokens - train) < self.block_size + 1:
            raise ConfigError("data.files", list(self.files),
                              f"text enough for a window of data.block_size + 1 = {self.block_size + 1} tokens in "
                              f"each split: its {cache.num_tokens} tokens give train {train} and val "
                              f"{cache.num_tokens - train} (data.val_fraction={self.val_fraction})")
        if not built:
            return []
        return [f"data.files: {cache.num_documents} documents tokenised into {cache.num_tokens} tokens once, "
                f"cached in {cache.folder}"]


@DATA.register("text", TextConfig)
class TextDataModule(DataModule):
    """Next-token prediction on your own text, tokenised once and memory-mapped from the token cache."""

    def __init__(self, cfg: TextConfig, micro_batch_size: int, seed: int) -> None:
        super().__init__(micro_batch_size, seed, cfg.num_workers)
        self.cfg = cfg
        self.cache, _ = cfg.token_cache()  # validation has built it: this opens it
        self._spec = DataSpec(kind="text", vocab_size=self.cache.vocab_size, block_size=cfg.block_size)

    @property
    def spec(self) -> DataSpec:
        """Text, the tokenizer's vocabulary, the configured block size."""
        return self._spec

    def _datasets(self) -> dict[str, Dataset]:
        c, split = self.cfg, self.cfg.split(self.cache.num_tokens)
        train, val = self.cache.tokens(0, split), self.cache.tokens(split)
        return train_val_windows(train, val, c.block_size, c.samples_per_epoch, c.val_windows, self.seed)
