"""Instruction and chat data (``data=chat``): conversations formatted with the tokenizer's chat template, one
padded row per sample, the loss on the assistant's tokens only."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from omegaconf import MISSING
from torch.utils.data import Dataset

from disttrain import checks
from disttrain.data.base import IGNORE_INDEX, BatchIndices, DataModule, index_tensor
from disttrain.data.chat_cache import TOO_LONG, ChatCache, ChatSources, ensure_chat_cache
from disttrain.data.chat_rows import RowFields, check_chat_files
from disttrain.data.registry import DATA
from disttrain.data.spec import DataSpec
from disttrain.data.token_cache import DEFAULT_CACHE, load_tokenizer
from disttrain.errors import ConfigError


@dataclass
class ChatConfig:
    """Conversations from ``.jsonl`` files (one JSON object per line) and Parquet files (one row each; read a
    record batch at a time), formatted with the chat template of the tokenizer in ``tokenizer`` and trained on
    the assistant's tokens only: every other target is ignored.

    A row holds its conversation under ``messages_key`` as a list of ``{"role", "content"}`` messages (roles
    ``system``, ``user``, ``assistant``), or a single exchange as strings under ``prompt_key`` (the user's) and
    ``response_key`` (the assistant's). A tokenizer without a chat template writes each message as ``<|role|>``
    on its own line, the content and a newline, an assistant's content ending in the end-of-text token
    (``disttrain.data.chat_format.PLAIN_CHAT_TEMPLATE``).

    Each row is one sample, padded to ``block_size`` (its targets ignored where padded), not packed with others:
    packed rows would attend to each other, which the models cannot yet prevent, so a row's loss would depend on
    its neighbours. A row of ``block_size + 1`` tokens fills a sample (the inputs and, one token on, the
    targets); a longer one is truncated or dropped (``too_long``), and the count is reported at the start and in
    ``results.json``. Rows are tokenised once, before ranks start, and cached under ``cache_dir``; the last
    ``val_fraction`` of the kept rows is validation (and test). Training rows are shuffled per epoch like every
    data set's, in one global order that resumes on any data-parallel size.
    """

    name: str = "chat"
    """Registry name."""
    files: list[str] = MISSING
    """The .jsonl and .parquet files, in order."""
    tokenizer: str = MISSING
    """Folder holding a Hugging Face ``tokenizer.json`` (and optionally ``tokenizer_config.json`` and a chat
    template: ``chat_template.jinja``, or ``chat_template`` in ``tokenizer_config.json``)."""
    messages_key: str = "messages"
    """Key of a row's list of messages."""
    prompt_key: str = "prompt"
    """Key of a row's prompt, for rows without messages."""
    response_key: str = "response"
    """Key of a row's response, for rows without messages."""
    too_long: str = "truncate"
    """A row longer than ``block_size + 1`` tokens: ``truncate`` (keep its start; a row left with no assistant
    token to predict is dropped) or ``drop``."""
    cache_dir: str | None = None
    """Folder of the token caches. None: ``.disttrain-tokens`` beside the first file."""
    block_size: int = 64
    """Tokens per sample (the model's context length)."""
    val_fraction: float = 0.1
    """Fraction of the rows, taken from the end, held out for validation and test."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""

    def sources(self) -> ChatSources:
        """The files, tokenizer and cache folder as absolute paths; ConfigError for a bad file list."""
        files = check_chat_files(self.files)
        cache_dir = self.cache_dir if self.cache_dir is not None else os.path.join(os.path.dirname(files[0]),
                                                                                   DEFAULT_CACHE)
        fields = RowFields(self.messages_key, self.prompt_key, self.response_key)
        return ChatSources(tuple(files), os.path.abspath(os.path.expanduser(self.tokenizer)), fields,
                           self.block_size + 1, self.too_long, os.path.abspath(os.path.expanduser(cache_dir)))

    def chat_cache(self) -> tuple[ChatCache, bool]:
        """The cache of these files and tokenizer, built on first use; and whether this call built it."""
        return ensure_chat_cache(self.sources())

    def split(self, rows: int) -> int:
        """Where validation starts: the last ``val_fraction`` of ``rows`` is held out."""
        return rows - int(rows * self.val_fraction)

    def validate(self) -> list[str]:
        """Check the options, the files and the tokenizer, tokenise every row if the cache is missing (here, in the
        job process, before any rank starts) and check that each split keeps a row; the line that reports them."""
        checks.positive("data.block_size", self.block_size)
        checks.fraction("data.val_fraction", self.val_fraction)
        checks.non_negative("data.num_workers", self.num_workers)
        if self.too_long not in TOO_LONG:
            raise ConfigError("data.too_long", self.too_long, " or ".join(TOO_LONG))
        for key in ("messages_key", "prompt_key", "response_key"):
            if not getattr(self, key):
                raise ConfigError(f"data.{key}", getattr(self, key), "the name of a field of the rows")
        load_tokenizer(os.path.abspath(os.path.expanduser(self.tokenizer)))  # before the files are read
        cache, _ = self.chat_cache()
        train = self.split(cache.counts.rows)
        if min(train, cache.counts.rows - train) < 1:
            raise ConfigError("data.val_fraction", self.val_fraction,
                              f"a fraction that leaves a row in each split: {cache.counts.rows} rows are kept of "
                              f"{cache.counts.rows_read} (data.files={self.files})")
        return [chat_report_line(cache, self.block_size, self.too_long, train)]


def chat_report_line(cache: ChatCache, block_size: int, too_long: str, train: int) -> str:
    """The line a run starts with: rows read and kept, and what became of those longer than the window."""
    c = cache.counts
    line = (f"data.files: {c.rows_read} chat rows, {c.rows} kept ({train} train, {c.rows - train} val); "
            f"{c.truncated + c.dropped_too_long} longer than data.block_size + 1 = {block_size + 1} tokens "
            f"({c.truncated} truncated, {c.dropped_too_long} dropped: data.too_long={too_long})")
    if c.dropped_no_target:
        line += f"; {c.dropped_no_target} dropped with no assistant token inside the window"
    return line


class ChatRows(Dataset):
    """Rows ``first`` to ``last`` of a chat cache as samples: ``block_size`` input ids padded with ``pad_id``, and
    as targets the next ids where they are the assistant's, ``IGNORE_INDEX`` elsewhere."""

    def __init__(self, cache: ChatCache, first: int, last: int, block_size: int) -> None:
        self.tokens, self.assistant = cache.tokens(), cache.assistant()
        self.starts = cache.starts(first, last)
        self.block_size, self.pad_id = block_size, cache.pad_id

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start, end = int(self.starts[index]), int(self.starts[index + 1])
        ids = np.asarray(self.tokens[start:end], dtype=np.int64)
        learned = np.asarray(self.assistant[start:end], dtype=np.bool_)
        inputs = np.full(self.block_size, self.pad_id, dtype=np.int64)
        targets = np.full(self.block_size, IGNORE_INDEX, dtype=np.int64)
        inputs[:len(ids) - 1] = ids[:-1]
        targets[:len(ids) - 1] = np.where(learned[1:], ids[1:], IGNORE_INDEX)
        return torch.from_numpy(inputs), torch.from_numpy(targets)

    def get_batch(self, indices: BatchIndices) -> tuple[torch.Tensor, torch.Tensor]:
        """The samples of ``indices`` stacked, as a DataLoader would collate them."""
        samples = [self[i] for i in index_tensor(indices).tolist()]
        return torch.stack([s[0] for s in samples]), torch.stack([s[1] for s in samples])


@DATA.register("chat", ChatConfig)
class ChatDataModule(DataModule):
    """Supervised fine-tuning on conversations: the assistant's tokens are the only targets."""

    def __init__(self, cfg: ChatConfig, micro_batch_size: int, seed: int) -> None:
        super().__init__(micro_batch_size, seed, cfg.num_workers)
        self.cfg = cfg
        self.cache, _ = cfg.chat_cache()  # validation has built it: this opens it
        self._spec = DataSpec(kind="text", vocab_size=self.cache.vocab_size, block_size=cfg.block_size,
                              masked_targets=True)

    @property
    def spec(self) -> DataSpec:
        """Text, the tokenizer's vocabulary, the configured block size."""
        return self._spec

    def report(self) -> dict[str, Any]:
        """The ``data`` section of ``results.json``: rows read, kept, truncated and dropped, and the splits."""
        train = self.cfg.split(self.cache.counts.rows)
        return {**asdict(self.cache.counts), "train_rows": train, "val_rows": self.cache.counts.rows - train,
                "too_long": self.cfg.too_long}

    def _datasets(self) -> dict[str, Dataset]:
        rows, block = self.cache.counts.rows, self.cfg.block_size
        split = self.cfg.split(rows)
        evaluation = ChatRows(self.cache, split, rows, block)
        return {"train": ChatRows(self.cache, 0, split, block), "val": evaluation, "test": evaluation}
