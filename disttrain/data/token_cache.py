"""The user's text as token ids: tokenised once with a Hugging Face tokenizer and cached as a flat file.

A cache is a folder ``<cache_dir>/<key>/`` holding ``tokens.bin`` (the ids as ``uint16``, or ``uint32`` for
vocabularies beyond 65536) and ``tokens.json`` (dtype, counts, vocabulary, end-of-text id, sources). The key
hashes every file's path, size and modification time, the tokenizer file's contents, the text key and the
end-of-text id, so a cache is reused while they stay the same and a new one is built when one changes.
A cache is written into a private temporary folder and renamed into place in one step, so no process ever
reads a half-written one; when two processes build the same key, the first rename wins and the other's
copy is removed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from disttrain.data.documents import read_documents
from disttrain.data.windows import MemmapTokens
from disttrain.errors import ConfigError

TOKENIZER_FILE = "tokenizer.json"
"""The file a tokenizer folder must hold (Hugging Face ``tokenizers``' serialisation)."""
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
"""Optional ``transformers`` settings beside it; its ``eos_token`` names the end-of-text token."""
TOKENS_FILE = "tokens.bin"
"""A cache's ids, one flat array."""
META_FILE = "tokens.json"
"""A cache's description; written last, so a folder holding it is complete."""
FORMAT = 1
"""Version of the cache layout; part of the key, so a new layout never reads an old cache."""
END_OF_TEXT_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
"""Special tokens taken as the document separator when neither ``data.eos_token`` nor the tokenizer's
config names one."""
DEFAULT_CACHE = ".disttrain-tokens"
"""Name of the cache folder made beside the data when ``data.cache_dir`` is not set."""
ENCODE_BATCH = 256
"""Documents handed to the tokenizer at once (it encodes a batch on several threads)."""


@dataclass(frozen=True)
class TextSources:
    """What a token cache is made from."""

    files: tuple[str, ...]
    """Absolute paths of the .txt and .jsonl files, in order."""
    tokenizer: str
    """Folder holding ``tokenizer.json``."""
    text_key: str
    """Key of the text in each JSON line."""
    eos_token: str | None
    """The separator token's text; None: found in the tokenizer (see ``end_of_text_id``)."""
    cache_dir: str
    """Folder under which caches live, one subfolder per key."""


@dataclass(frozen=True)
class TokenCache:
    """A built cache: where it is and what it holds."""

    folder: str
    """The cache's own folder (``<cache_dir>/<key>``)."""
    dtype: str
    """numpy dtype of the ids in ``tokens.bin``."""
    num_tokens: int
    """Ids in ``tokens.bin``."""
    num_documents: int
    """Documents that were tokenised."""
    vocab_size: int
    """The tokenizer's vocabulary, added tokens included."""
    eos_id: int | None
    """Id placed between documents, or None when the tokenizer has no end-of-text token."""

    def tokens(self, start: int = 0, length: int | None = None) -> MemmapTokens:
        """Ids ``start`` to ``start + length`` (default: to the end), memory-mapped on first access."""
        return MemmapTokens(os.path.join(self.folder, TOKENS_FILE), np.dtype(self.dtype), start,
                            self.num_tokens - start if length is None else length)


def load_tokenizer(folder: str) -> Any:
    """The ``tokenizers.Tokenizer`` saved in ``folder/tokenizer.json`` (read locally, never downloaded)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("data.tokenizer", folder, "usable once the tokenizers package is installed "
                                                   "(pip install 'disttrain[hf]')") from None
    path = os.path.join(folder, TOKENIZER_FILE)
    if not os.path.isfile(path):
        raise ConfigError("data.tokenizer", folder, f"a folder holding {TOKENIZER_FILE} (a Hugging Face tokenizer "
                                                    "saved with save_pretrained or Tokenizer.save)")
    try:
        return Tokenizer.from_file(path)
    except Exception as err:  # the Rust side raises plain Exceptions for malformed files
        raise ConfigError("data.tokenizer", folder, f"a readable {TOKENIZER_FILE}: {err}") from None


def end_of_text_id(tokenizer: Any, folder: str, eos_token: str | None) -> int | None:
    """Id of ``eos_token``; when None, of ``tokenizer_config.json``'s ``eos_token``, else of the first special
    token in ``END_OF_TEXT_NAMES``, else None (documents are then joined without a separator)."""
    if eos_token is not None:
        token_id = tokenizer.token_to_id(eos_token)
        if token_id is None:
            raise ConfigError("data.eos_token", eos_token, "a token of the tokenizer, or null to find its own")
        return token_id
    configured = _configured_eos(folder)
    if configured is not None and tokenizer.token_to_id(configured) is not None:
        return tokenizer.token_to_id(configured)
    specials = {token.content for token in tokenizer.get_added_tokens_decoder().values() if token.special}
    return next((tokenizer.token_to_id(name) for name in END_OF_TEXT_NAMES if name in specials), None)


def _configured_eos(folder: str) -> str | None:
    """``eos_token`` of ``tokenizer_config.json`` (a string or ``{"content": ...}``), if the file names one."""
    path = os.path.join(folder, TOKENIZER_CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            token = json.load(handle).get("eos_token")
    except (OSError, ValueError, AttributeError) as err:
        raise ConfigError("data.tokenizer", folder, f"a readable {TOKENIZER_CONFIG_FILE}: {err}") from None
    return token.get("content") if isinstance(token, dict) else token if isinstance(token, str) else None


def cache_key(sources: TextSources, eos_id: int | None) -> str:
    """Hash of what the tokens depend on: the files' paths, sizes and modification times, the tokenizer
    file's contents, the text key and the separator id."""
    tokenizer_hash = tokenizer_digest(sources.tokenizer)
    stats = [(path, os.stat(path).st_size, os.stat(path).st_mtime_ns) for path in sources.files]
    described = json.dumps({"format": FORMAT, "files": stats, "tokenizer": tokenizer_hash,
                            "text_key": sources.text_key, "eos_id": eos_id})
    return hashlib.sha256(described.encode()).hexdigest()[:24]


def tokenizer_digest(folder: str) -> str:
    """SHA-256 of the tokenizer file in ``folder``: what every cache of its tokens is keyed by."""
    with open(os.path.join(folder, TOKENIZER_FILE), "rb") as handle:
        return hashlib.sha256(handle.read()).hexdigest()


def ensure_token_cache(sources: TextSources) -> tuple[TokenCache, bool]:
    """The cache of ``sources``, built if it does not exist yet; and whether this call built it."""
    tokenizer = load_tokenizer(sources.tokenizer)
    eos_id = end_of_text_id(tokenizer, sources.tokenizer, sources.eos_token)
    folder = os.path.join(sources.cache_dir, cache_key(sources, eos_id))
    if os.path.isfile(os.path.join(folder, META_FILE)):
        return open_token_cache(folder), False
    make_cache_dir(sources.cache_dir, "the token cache")
    _build(sources, tokenizer, eos_id, folder)
    return open_token_cache(folder), True


def make_cache_dir(cache_dir: str, what: str) -> None:
    """Create ``cache_dir`` if needed; ConfigError naming ``data.cache_dir`` when it cannot be created or written
    (``what`` is built there)."""
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as err:
        raise ConfigError("data.cache_dir", cache_dir, f"a folder this process can create: {err}") from None
    if not os.access(cache_dir, os.W_OK):
        raise ConfigError("data.cache_dir", cache_dir, f"a writable folder ({what} is built there)")


def open_token_cache(folder: str) -> TokenCache:
    """The cache in ``folder``, after checking that ``tokens.bin`` holds as many ids as ``tokens.json`` says."""
    with open(os.path.join(folder, META_FILE), encoding="utf-8") as handle:
        meta = json.load(handle)
    cache = TokenCache(**{name: meta[name] for name in TokenCache.__dataclass_fields__ if name != "folder"},
                       folder=folder)
    size = os.path.getsize(os.path.join(folder, TOKENS_FILE))
    if size != cache.num_tokens * np.dtype(cache.dtype).itemsize:
        raise ConfigError("data.cache_dir", os.path.dirname(folder),
                          f"a cache whose {TOKENS_FILE} matches {META_FILE}: {folder} does not (delete it to rebuild)")
    return cache


def publish(staging: str, folder: str, meta: dict[str, Any], meta_file: str = META_FILE) -> None:
    """Write ``meta`` as the ``staging`` folder's ``meta_file`` and rename the folder to ``folder`` in one step;
    another process's finished cache already there is kept (the two hold the same tokens)."""
    with open(os.path.join(staging, meta_file), "w", encoding="utf-8") as handle:
        json.dump(meta, handle, indent=1)
    try:
        os.rename(staging, folder)
    except OSError:
        if not os.path.isfile(os.path.join(folder, meta_file)):
            raise  # not another process's finished cache in the way: a real failure


def _build(sources: TextSources, tokenizer: Any, eos_id: int | None, folder: str) -> None:
    """Tokenise every document into a temporary folder, then rename it to ``folder`` in one step."""
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.", dir=sources.cache_dir)
    try:
        num_tokens = num_documents = 0
        with open(os.path.join(staging, TOKENS_FILE), "wb") as out:
            for ids in _document_ids(sources, tokenizer):
                if num_documents and eos_id is not None:
                    ids = [eos_id, *ids]
                np.asarray(ids, dtype=dtype).tofile(out)
                num_tokens += len(ids)
                num_documents += 1
        meta = {**asdict(TokenCache(folder, dtype.name, num_tokens, num_documents, vocab_size, eos_id)),
                "files": list(sources.files), "text_key": sources.text_key}
        del meta["folder"]
        publish(staging, folder, meta)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _document_ids(sources: TextSources, tokenizer: Any) -> Iterator[list[int]]:
    """Token ids of every document of every file, in order, without the tokenizer's own special tokens
    (the separator is added between documents instead)."""
    for path in sources.files:
        for batch in _batched(read_documents(path, sources.text_key), ENCODE_BATCH):
            for encoding in tokenizer.encode_batch(batch, add_special_tokens=False):
                yield encoding.ids


def _batched(items: Iterable[str], size: int) -> Iterator[list[str]]:
    """``items`` in lists of ``size`` (the last may be shorter)."""
    iterator = iter(items)
    while batch := list(itertools.islice(iterator, size)):
        yield batch
