"""``data=mixture``'s options: its sources by weight, their checks, and the plan a worker reads the stream by (each
source's length index, built here where missing, the tokenizer's end-of-document id and the sizes)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from omegaconf import MISSING

from disttrain import checks
from disttrain.data.length_index import ensure_length_index
from disttrain.data.mixture_layout import MixturePlan
from disttrain.data.token_cache import DEFAULT_CACHE
from disttrain.errors import ConfigError

ON_EXHAUSTED = ("wrap", "end_epoch")
"""What a source that runs out of training documents does."""

SOURCE_NAME = re.compile(r"[A-Za-z0-9_.-]+")
"""A source's name: one part of a metric's key."""


@dataclass
class MixtureSource:
    """One source of the mixture."""

    path: str = MISSING
    """A file, a glob of .parquet, .arrow, .jsonl and .txt files (a .txt file is one document), or a folder
    written by ``datasets.Dataset.save_to_disk`` (a saved ``DatasetDict``: its train split)."""
    weight: float = 1.0
    """Share of the documents drawn from this source, relative to the others' weights (0: never drawn)."""
    field: str = "text"
    """The column or JSON key holding each document's text."""
    name: str | None = None
    """The source's name in its validation loss ``val/loss/<name>`` (letters, digits, ``_``, ``-``, ``.``; unique
    among the sources). None: the file's or folder's name without extension (a glob's: its folder's)."""


@dataclass
class MixtureConfig:
    """Text sources mixed by weight, tokenised in the loader workers as they stream, packed into windows.

    Each source's last ``val_documents`` documents are held out for validation (and test); training draws from the
    others: each document comes from a source picked by weight with a counter-based generator seeded by the run.
    """

    name: str = "mixture"
    """Registry name."""
    sources: list[MixtureSource] = MISSING
    """The sources, e.g. ``[{path: web/*.parquet, weight: 3}, {path: code.jsonl, weight: 1, field: content}]``."""
    tokenizer: str = MISSING
    """Folder holding a Hugging Face ``tokenizer.json`` (and optionally ``tokenizer_config.json``)."""
    eos_token: str | None = None
    """End-of-document token placed after every document. None: ``tokenizer_config.json``'s eos_token, else the
    first of <|endoftext|>, </s>, <eos>, <|end_of_text|> that is a special token of the tokenizer."""
    block_size: int = 64
    """Tokens per window (the model's context length)."""
    samples_per_epoch: int = 1024
    """Windows per epoch over all ranks (cut to whole global batches): the stream goes on across epochs, so an
    epoch only paces validation, checkpoints and the schedule."""
    on_exhausted: str = "wrap"
    """A source out of training documents: ``wrap`` starts it again (its passes are counted in the results) or
    ``end_epoch`` ends the epoch, after which every source starts again with fresh draws."""
    document_mask: bool = True
    """Models keep each packed document to itself (``DataSpec.document_end`` set); false: windows attend across them."""
    val_documents: int = 8
    """Documents held out at the end of each source for validation and test."""
    val_windows: int | None = None
    """Cap on each source's consecutive validation windows. None: all its held-out documents fill."""
    num_workers: int = 0
    """DataLoader worker processes per rank; each reads and tokenises only the documents of its own windows."""
    cache_dir: str | None = None
    """Folder of each source's length index (its documents' token counts, built once before ranks start; one
    subfolder per source's files, field and tokenizer). None: ``.disttrain-tokens`` in the folder of the first
    source's path."""
    read_log: str | None = None
    """Folder where each rank appends, per trained micro-batch, the documents of every window
    (``rank<N>.jsonl``: source, document, pass, first and last token); None: no log."""

    def validate(self) -> list[str]:
        """Check the sizes, every source's files, fields and weights, and the tokenizer; ConfigError naming the
        source's key and file otherwise."""
        checks.positive("data.block_size", self.block_size)
        checks.positive("data.samples_per_epoch", self.samples_per_epoch)
        checks.one_of("data.on_exhausted", self.on_exhausted, ON_EXHAUSTED)
        checks.positive("data.val_documents", self.val_documents)
        checks.positive("data.val_windows", self.val_windows, optional=True)
        checks.non_negative("data.num_workers", self.num_workers)
        self.source_names()
        return self._plan(seed=0)[1]

    def source_names(self) -> tuple[str, ...]:
        """Each source's ``name``, or its path's stem (a glob's folder), checked to be unique metric key parts."""
        names = []
        for index, source in enumerate(self.sources):
            name = source.name
            if name is None:
                path = os.path.normpath(str(source.path))
                name = os.path.splitext(os.path.basename(os.path.dirname(path) if glob_like(path) else path))[0]
                name = re.sub(r"[^A-Za-z0-9_.-]", "_", name)
            key = f"data.sources[{index}].name"
            if not SOURCE_NAME.fullmatch(name):
                raise ConfigError(key, name, "letters, digits, '_', '-' and '.' (a part of the key val/loss/<name>)")
            if name in names:
                raise ConfigError(key, name, f"a name no other source has (sources {names} come before); set "
                                             "data.sources[i].name")
            names.append(name)
        return tuple(names)

    def cache_folder(self) -> str:
        """``data.cache_dir``, else ``.disttrain-tokens`` in the folder of the first source's path (a glob's folder,
        a saved dataset folder's parent), as an absolute path."""
        if self.cache_dir is not None:
            return os.path.abspath(os.path.expanduser(self.cache_dir))
        first = os.path.normpath(os.path.abspath(os.path.expanduser(str(self.sources[0].path))))
        return os.path.join(os.path.dirname(first), DEFAULT_CACHE)

    def plan(self, seed: int) -> MixturePlan:
        """The sources with their length indexes (built where missing), the tokenizer's end-of-document id and the
        sizes, as workers need them."""
        return self._plan(seed)[0]

    def _plan(self, seed: int) -> tuple[MixturePlan, list[str]]:
        """The plan, and a notice for each length index this call built."""
        from disttrain.data.token_cache import end_of_text_id, load_tokenizer

        if not self.sources:
            raise ConfigError("data.sources", [], "a list of one or more {path, weight, field} sources")
        weights = [float(source.weight) for source in self.sources]
        for index, weight in enumerate(weights):
            if not weight >= 0:
                raise ConfigError(f"data.sources[{index}].weight", weight, "a number >= 0")
        if sum(weights) <= 0:
            raise ConfigError("data.sources", weights, "weights of which at least one is above 0")
        folder = os.path.abspath(os.path.expanduser(self.tokenizer))
        load_tokenizer(folder)  # a missing or unreadable tokenizer is named before any source is read
        resolved, train_documents, notices = [], [], []
        for index, source in enumerate(self.sources):
            key = f"data.sources[{index}].path"
            files, built = ensure_length_index(key, source.path, source.field, folder, self.cache_folder())
            if built:
                notices.append(f"{key}: {files.num_documents} documents read and their {files.num_tokens} tokens "
                               f"counted once, indexed in {files.folder}")
            if files.num_documents <= self.val_documents:
                raise ConfigError(key, source.path, f"a source of more than data.val_documents={self.val_documents} "
                                                    f"documents (held out at its end); it holds {files.num_documents}")
            resolved.append(files)
            train_documents.append(files.num_documents - self.val_documents)
        eos_id = end_of_text_id(load_tokenizer(folder), folder, self.eos_token)
        if eos_id is None:
            raise ConfigError("data.eos_token", self.eos_token, "a token of the tokenizer to end each document; this "
                                                                "tokenizer names none of its own")
        return MixturePlan(tuple(resolved), tuple(train_documents), tuple(weights), folder, eos_id, self.block_size,
                           seed, self.on_exhausted == "wrap"), notices


def glob_like(path: str) -> bool:
    """Whether ``path`` is a glob pattern rather than one file or folder."""
    return any(character in path for character in "*?[")
