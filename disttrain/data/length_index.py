"""Each mixture source's document lengths under the run's tokenizer, counted once and cached beside the token caches.

The index of a source is a folder ``<cache_dir>/lengths-<key>/`` holding ``lengths.bin`` (each document's token
count without the end-of-document token, ``uint32``), ``offsets.bin`` (each document's byte offset in its JSON-lines
file, ``uint64``; 0 for other kinds of file) and ``lengths.json`` (the files, documents per file, tokens). The key
hashes every file's path, size and modification time, the text field and the tokenizer file's contents, so the
index is reused while they stay the same and built again when one changes. It is built in a private folder and
renamed into place in one step (``token_cache.publish``), so no process reads a half-written one.

Building it reads and tokenises every document once, which also checks every Parquet page and every JSON line: a
file that would fail only inside a loader worker is refused here, before ranks start. From the lengths alone a
loader worker places every document of the stream and tokenises only the documents of its own windows.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from disttrain.data.sources import DocumentReader, SourceFiles, scan_file, source_files
from disttrain.data.token_cache import (
    ENCODE_BATCH,
    load_tokenizer,
    make_cache_dir,
    publish,
    tokenizer_digest,
)
from disttrain.errors import ConfigError

LENGTHS_FILE = "lengths.bin"
"""Each document's token count (``uint32``), without its end-of-document token."""
OFFSETS_FILE = "offsets.bin"
"""Each document's byte offset in its JSON-lines file (``uint64``; 0 for Parquet, Arrow and text files)."""
INDEX_META = "lengths.json"
"""The index's description; written last, so a folder holding it is complete."""
INDEX_FORMAT = 1
"""Version of the index layout; part of the key, so a new layout never reads an old index."""
INDEX_PREFIX = "lengths-"
"""Start of an index folder's name in the cache folder (token caches are named by their key alone)."""


@dataclass(frozen=True)
class IndexedSource:
    """A source's files with its length index: what a loader worker reads and places documents by."""

    files: SourceFiles
    """The files, their documents per file and the config key that named them."""
    folder: str
    """The index's folder."""
    num_tokens: int
    """Tokens of all the source's documents, end-of-document tokens not counted."""

    @property
    def num_documents(self) -> int:
        """Documents in the whole source."""
        return self.files.num_documents

    def lengths(self) -> np.ndarray:
        """Each document's token count, memory-mapped (read-only)."""
        return self._mapped(LENGTHS_FILE, np.uint32)

    def reader(self) -> DocumentReader:
        """A reader of any document of the source by its number."""
        return DocumentReader(self.files, self._mapped(OFFSETS_FILE, np.uint64))

    def _mapped(self, name: str, dtype: type) -> np.ndarray:
        """One of the index's arrays, memory-mapped (numpy cannot map an empty file)."""
        if not self.num_documents:
            return np.zeros(0, dtype)
        return np.memmap(os.path.join(self.folder, name), dtype=dtype, mode="r", shape=(self.num_documents,))


def index_key(files: tuple[str, ...], field: str, tokenizer: str) -> str:
    """Hash of what the lengths depend on: the files' paths, sizes and modification times, the field and the
    tokenizer file's contents."""
    stats = [(path, os.stat(path).st_size, os.stat(path).st_mtime_ns) for path in files]
    described = json.dumps({"format": INDEX_FORMAT, "files": stats, "field": field,
                            "tokenizer": tokenizer_digest(tokenizer)})
    return hashlib.sha256(described.encode()).hexdigest()[:24]


def ensure_length_index(key: str, pattern: str, field: str, tokenizer: str,
                        cache_dir: str) -> tuple[IndexedSource, bool]:
    """The length index of the source ``pattern`` names (built if it does not exist yet, reading every document),
    and whether this call built it. ConfigError naming ``key`` and the file for a file that cannot be read, and for
    a source without any document."""
    files = source_files(key, pattern)
    folder = os.path.join(cache_dir, INDEX_PREFIX + index_key(files, field, tokenizer))
    built = not os.path.isfile(os.path.join(folder, INDEX_META))
    if built:
        make_cache_dir(cache_dir, "the sources' length indexes")
        _build(key, files, field, tokenizer, cache_dir, folder)
    source = open_length_index(folder, key, field)
    if source.num_documents == 0:
        raise ConfigError(key, pattern, f"a source holding documents; its {len(files)} file(s) hold none")
    return source, built


def open_length_index(folder: str, key: str, field: str) -> IndexedSource:
    """The index in ``folder``, after checking that its arrays hold as many documents as its description says;
    ConfigError naming ``data.cache_dir`` otherwise."""
    with open(os.path.join(folder, INDEX_META), encoding="utf-8") as handle:
        meta = json.load(handle)
    documents = sum(meta["counts"])
    for name, dtype in ((LENGTHS_FILE, np.uint32), (OFFSETS_FILE, np.uint64)):
        if os.path.getsize(os.path.join(folder, name)) != documents * np.dtype(dtype).itemsize:
            raise ConfigError("data.cache_dir", os.path.dirname(folder),
                              f"an index whose {name} matches {INDEX_META}: {folder} does not (delete it to rebuild)")
    files = SourceFiles(key, field, tuple(meta["files"]), tuple(meta["counts"]))
    return IndexedSource(files, folder, int(meta["tokens"]))


def _build(key: str, files: tuple[str, ...], field: str, tokenizer_folder: str, cache_dir: str,
           folder: str) -> None:
    """Read and tokenise every document into a private folder, then rename it to ``folder`` in one step."""
    tokenizer = load_tokenizer(tokenizer_folder)
    staging = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.", dir=cache_dir)
    try:
        counts, tokens = [], 0
        with open(os.path.join(staging, LENGTHS_FILE), "wb") as lengths, \
                open(os.path.join(staging, OFFSETS_FILE), "wb") as offsets:
            for path in files:
                count = 0
                for texts, starts in _batches(scan_file(path, field, key)):
                    counted = np.asarray([len(encoding.ids) for encoding in
                                          tokenizer.encode_batch(texts, add_special_tokens=False)], dtype=np.uint32)
                    counted.tofile(lengths)
                    np.asarray(starts, dtype=np.uint64).tofile(offsets)
                    count, tokens = count + len(texts), tokens + int(counted.sum())
                counts.append(count)
        meta: dict[str, Any] = {"format": INDEX_FORMAT, "files": list(files), "counts": counts, "tokens": tokens,
                                "field": field}
        publish(staging, folder, meta, INDEX_META)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _batches(documents: Iterable[tuple[str, int]]) -> Iterator[tuple[list[str], list[int]]]:
    """``(texts, offsets)`` of ``ENCODE_BATCH`` documents at a time (the tokenizer encodes a batch on several
    threads)."""
    texts: list[str] = []
    starts: list[int] = []
    for text, start in documents:
        texts.append(text)
        starts.append(start)
        if len(texts) == ENCODE_BATCH:
            yield texts, starts
            texts, starts = [], []
    if texts:
        yield texts, starts
