"""Chat rows as token ids and assistant masks: tokenised once, in the job process, and cached as flat files.

A cache is a folder ``<cache_dir>/chat-<key>/`` holding ``tokens.bin`` (every kept row's ids, one after another,
``uint16`` or ``uint32``), ``assistant.bin`` (one byte per id: 1 where the id is the assistant's), ``starts.bin``
(``int64``: where each row starts, and the end) and ``chat.json`` (the counts, written last). Rows already fit
the window: a longer one was truncated or dropped when the cache was built, as ``data.too_long`` says. The key
hashes the files' paths, sizes and modification times, the tokenizer folder's files, the row fields, the window
and ``too_long``; a cache is written into a private folder and renamed into place in one step, as the text
token cache is (``disttrain.data.token_cache``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import numpy as np

from disttrain.data.chat_format import PLAIN_CHAT_TEMPLATE, load_chat_tokenizer, tokenize_conversation
from disttrain.data.chat_rows import RowFields, read_conversations
from disttrain.data.token_cache import publish
from disttrain.data.windows import MemmapTokens
from disttrain.errors import ConfigError

FORMAT = 1
"""Version of the cache layout; part of the key."""
META_FILE = "chat.json"
"""A cache's counts; written last, so a folder holding it is complete."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json")
"""The files of a tokenizer folder that decide how a conversation is tokenised (part of the key)."""
TOO_LONG = ("truncate", "drop")
"""What ``data.too_long`` may say of a row longer than the window."""


@dataclass(frozen=True)
class ChatSources:
    """What a chat cache is made from."""

    files: tuple[str, ...]
    """Absolute paths of the .jsonl and .parquet files, in order."""
    tokenizer: str
    """Folder holding the tokenizer (and its chat template, if it has one)."""
    fields: RowFields
    """Where each row keeps its conversation."""
    window: int
    """Most tokens a row may keep: ``data.block_size`` inputs plus the last target."""
    too_long: str
    """``truncate`` or ``drop``: what becomes of a longer row."""
    cache_dir: str
    """Folder under which caches live, one subfolder per key."""


@dataclass(frozen=True)
class ChatCounts:
    """What building a cache found, row by row."""

    rows_read: int = 0
    """Rows in the files."""
    rows: int = 0
    """Rows kept."""
    truncated: int = 0
    """Rows longer than the window, cut to it (``too_long=truncate``) and kept."""
    dropped_too_long: int = 0
    """Rows longer than the window, dropped (``too_long=drop``)."""
    dropped_no_target: int = 0
    """Rows left without an assistant token to predict inside the window (truncation cut every one off, or the
    template writes nothing for an empty response), dropped: they carry no loss."""


@dataclass(frozen=True)
class ChatCache:
    """A built cache: where it is and what it holds."""

    folder: str
    """The cache's own folder."""
    dtype: str
    """numpy dtype of the ids in ``tokens.bin``."""
    num_tokens: int
    """Ids in ``tokens.bin``."""
    vocab_size: int
    """The tokenizer's vocabulary, added tokens included."""
    pad_id: int
    """Id that fills a row's inputs up to the window: the tokenizer's padding token, else its end-of-text token,
    else 0 (its targets are ignored, and the attention is causal, so what it is never matters)."""
    counts: ChatCounts = field(default_factory=ChatCounts)
    """What building it found."""

    def tokens(self) -> MemmapTokens:
        """Every kept row's ids, memory-mapped on first access."""
        return MemmapTokens(os.path.join(self.folder, "tokens.bin"), np.dtype(self.dtype))

    def assistant(self) -> MemmapTokens:
        """One byte per id: 1 where it is the assistant's."""
        return MemmapTokens(os.path.join(self.folder, "assistant.bin"), np.uint8)

    def starts(self, first: int, last: int) -> MemmapTokens:
        """Where rows ``first`` to ``last`` (excluded) start in ``tokens``, and where the last of them ends
        (``last - first + 1`` offsets), memory-mapped on first access."""
        return MemmapTokens(os.path.join(self.folder, "starts.bin"), np.int64, first, last - first + 1)


def cache_key(sources: ChatSources) -> str:
    """Hash of what the cache depends on."""
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = os.path.join(sources.tokenizer, name)
        if os.path.isfile(path):
            with open(path, "rb") as handle:
                digest.update(name.encode() + hashlib.sha256(handle.read()).digest())
    stats = [(path, os.stat(path).st_size, os.stat(path).st_mtime_ns) for path in sources.files]
    described = json.dumps({"format": FORMAT, "files": stats, "tokenizer": digest.hexdigest(),
                            "fields": asdict(sources.fields), "window": sources.window,
                            "too_long": sources.too_long, "plain_template": PLAIN_CHAT_TEMPLATE})
    return "chat-" + hashlib.sha256(described.encode()).hexdigest()[:24]


def ensure_chat_cache(sources: ChatSources) -> tuple[ChatCache, bool]:
    """The cache of ``sources``, built if it does not exist yet; and whether this call built it."""
    folder = os.path.join(sources.cache_dir, cache_key(sources))
    if os.path.isfile(os.path.join(folder, META_FILE)):
        return open_chat_cache(folder), False
    tokenizer = load_chat_tokenizer(sources.tokenizer)
    try:
        os.makedirs(sources.cache_dir, exist_ok=True)
    except OSError as err:
        raise ConfigError("data.cache_dir", sources.cache_dir, f"a folder this process can create: {err}") from None
    if not os.access(sources.cache_dir, os.W_OK):
        raise ConfigError("data.cache_dir", sources.cache_dir, "a writable folder (the chat cache is built there)")
    _build(sources, tokenizer, folder)
    return open_chat_cache(folder), True


def open_chat_cache(folder: str) -> ChatCache:
    """The cache in ``folder``."""
    with open(os.path.join(folder, META_FILE), encoding="utf-8") as handle:
        meta = json.load(handle)
    counts = ChatCounts(**meta["counts"])
    return ChatCache(folder, meta["dtype"], meta["num_tokens"], meta["vocab_size"], meta["pad_id"], counts)


def fitted_rows(sources: ChatSources, tokenizer: object) -> Iterator[tuple[np.ndarray, np.ndarray, bool] | str]:
    """Each row's ids, assistant mask and whether they were cut to the window (``too_long=truncate``); for a row
    that is not kept, the name of the ``ChatCounts`` field that counts it instead."""
    for path in sources.files:
        for number, messages in enumerate(read_conversations(path, sources.fields), start=1):
            ids, mask = tokenize_conversation(tokenizer, messages, f"row {number} of {path}")
            cut = len(ids) > sources.window
            if cut and sources.too_long == "drop":
                yield "dropped_too_long"
                continue
            ids, mask = ids[:sources.window], mask[:sources.window]
            if not mask[1:].any():  # the first token is never a target
                yield "dropped_no_target"
                continue
            yield ids, mask, cut


def _build(sources: ChatSources, tokenizer: object, folder: str) -> None:
    """Tokenise every row into a private folder, then rename it to ``folder`` in one step."""
    vocab_size = len(tokenizer)  # type: ignore[arg-type]
    dtype = np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)
    pad_id = next((i for i in (tokenizer.pad_token_id, tokenizer.eos_token_id) if i is not None), 0)  # type: ignore[attr-defined]
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.", dir=sources.cache_dir)
    counts = {name: 0 for name in ChatCounts.__dataclass_fields__}
    starts = [0]
    try:
        with open(os.path.join(staging, "tokens.bin"), "wb") as tokens, \
                open(os.path.join(staging, "assistant.bin"), "wb") as assistant:
            for row in fitted_rows(sources, tokenizer):
                counts["rows_read"] += 1
                if isinstance(row, str):
                    counts[row] += 1
                    continue
                ids, mask, cut = row
                ids.astype(dtype).tofile(tokens)
                mask.astype(np.uint8).tofile(assistant)
                starts.append(starts[-1] + len(ids))
                counts["rows"] += 1
                counts["truncated"] += cut
        np.asarray(starts, dtype=np.int64).tofile(os.path.join(staging, "starts.bin"))
        meta = {"format": FORMAT, "dtype": dtype.name, "num_tokens": starts[-1], "vocab_size": vocab_size,
                "pad_id": int(pad_id), "counts": counts, "files": list(sources.files),
                "tokenizer": sources.tokenizer}
        publish(staging, folder, meta, META_FILE)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
