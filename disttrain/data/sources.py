"""One source of a mixture: a path or glob of ``.parquet``, ``.arrow``, ``.jsonl`` and ``.txt`` files, or a folder
written by ``datasets.Dataset.save_to_disk``, read as a sequence of documents (the strings of one field).

Documents are numbered across the source's files in sorted order. Counting them reads only metadata (Parquet
footers, Arrow record-batch headers through a memory map) or lines (JSON lines, not parsed); reading them streams
record batches or lines from the requested document on, so no source is ever held whole in memory. Files are
read with pyarrow and the standard library alone: no pickle, no code from the files.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

from disttrain.errors import ConfigError

EXTENSIONS = (".parquet", ".arrow", ".jsonl", ".txt")
"""The file kinds a source may name."""
SAVED_DATASET_STATE = "state.json"
"""The file ``datasets.save_to_disk`` writes beside its Arrow files, listing them in order."""
SAVED_DATASET_DICT = "dataset_dict.json"
"""The file of a saved ``DatasetDict``: its ``train`` split is read."""
SOURCE_ALLOWED = ("a path or glob of .parquet, .arrow, .jsonl or .txt files, or a folder written by "
                  "datasets' save_to_disk")


@dataclass(frozen=True)
class SourceFiles:
    """A source's files and how many documents each holds."""

    key: str
    """The config key that named it (``data.sources[i].path``), for errors."""
    field: str
    """The text field of each record (JSON lines, Parquet and Arrow columns); unused for .txt files."""
    files: tuple[str, ...]
    """Absolute paths, in reading order."""
    counts: tuple[int, ...]
    """Documents in each file."""

    @property
    def num_documents(self) -> int:
        """Documents in the whole source."""
        return sum(self.counts)

    def documents(self, start: int, stop: int) -> Iterator[str]:
        """Documents ``start`` to ``stop - 1`` of the source, streamed (record batches or lines)."""
        offset = 0
        for path, count in zip(self.files, self.counts, strict=True):
            if start < offset + count and stop > offset:
                yield from _read_file(path, self.field, max(start - offset, 0), min(stop - offset, count), self.key)
            offset += count
            if offset >= stop:
                return


def resolve_source(key: str, pattern: str, field: str) -> SourceFiles:
    """The files a source's ``path`` names, each checked (readable, holding ``field``) and counted; ConfigError
    naming ``key`` and the file otherwise, and for a source without any document."""
    files = _expand(key, pattern)
    counts = tuple(_count(path, field, key) for path in files)
    source = SourceFiles(key, field, tuple(files), counts)
    if source.num_documents == 0:
        raise ConfigError(key, pattern, f"a source holding documents; its {len(files)} file(s) hold none")
    return source


def _expand(key: str, pattern: str) -> list[str]:
    """The files of a path, glob or saved dataset folder, sorted; ConfigError when there are none."""
    path = os.path.abspath(os.path.expanduser(pattern))
    if os.path.isdir(path):
        return _saved_dataset_files(key, path)
    names = sorted(glob.glob(path)) if glob.has_magic(path) else [path] if os.path.exists(path) else []
    if not names:
        raise ConfigError(key, pattern, f"{SOURCE_ALLOWED}; nothing exists there")
    for name in names:
        if not name.endswith(EXTENSIONS) or not os.path.isfile(name):
            raise ConfigError(key, pattern, f"{SOURCE_ALLOWED}; {name} is not one")
    return names


def _saved_dataset_files(key: str, folder: str) -> list[str]:
    """The Arrow files of a ``save_to_disk`` folder (its ``train`` split for a saved ``DatasetDict``), in order."""
    if os.path.isfile(os.path.join(folder, SAVED_DATASET_DICT)):
        folder = os.path.join(folder, "train")
    state = os.path.join(folder, SAVED_DATASET_STATE)
    if not os.path.isfile(state):
        raise ConfigError(key, folder, f"{SOURCE_ALLOWED}; this folder has no {SAVED_DATASET_STATE}")
    try:
        with open(state, encoding="utf-8") as handle:
            names = [entry["filename"] for entry in json.load(handle)["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(key, folder, f"a readable {SAVED_DATASET_STATE} listing its Arrow files: {err}") from None
    files = [os.path.join(folder, os.path.basename(name)) for name in names]
    missing = [name for name in files if not os.path.isfile(name)]
    if missing:
        raise ConfigError(key, folder, f"a saved dataset whose files exist; {missing[0]} does not")
    return files


def _count(path: str, field: str, key: str) -> int:
    """Documents in one file, after checking that it can be read and holds ``field``."""
    if path.endswith(".txt"):
        return 1
    if path.endswith(".jsonl"):
        return _count_lines(path, field, key)
    schema, rows = _arrow_schema_and_rows(path, key)
    if field not in schema.names:
        raise ConfigError(f"{key.rsplit('.', 1)[0]}.field", field,
                          f"a column of {path}; its columns: {schema.names[:10]}")
    import pyarrow as pa

    column_type = schema.field(field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise ConfigError(f"{key.rsplit('.', 1)[0]}.field", field, f"a string column of {path}; it holds {column_type}")
    return rows


def _count_lines(path: str, field: str, key: str) -> int:
    """Non-blank lines of a JSON-lines file; the first is parsed to check that it holds ``field``."""
    count = 0
    try:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                if line.strip():
                    if count == 0:
                        _line_text(line, field, path, 1, key)
                    count += 1
    except UnicodeDecodeError as err:
        raise ConfigError(key, path, f"UTF-8 text: {err}") from None
    return count


def _arrow_schema_and_rows(path: str, key: str):  # noqa: ANN202 (pyarrow's types are imported lazily)
    """Schema and row count of a Parquet file (its footer) or an Arrow file (its record-batch headers)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.endswith(".parquet"):
            metadata = pq.ParquetFile(path).metadata
            return metadata.schema.to_arrow_schema(), metadata.num_rows
        with _open_arrow(path) as reader:
            return reader.schema, sum(batch.num_rows for batch in _arrow_batches(reader))
    except (pa.ArrowException, OSError) as err:
        kind = "Parquet" if path.endswith(".parquet") else "Arrow"
        raise ConfigError(key, path, f"a readable {kind} file: {err}") from None


class _open_arrow:  # noqa: N801 (a context manager read like a function)
    """An Arrow IPC file or stream (the stream form is what ``datasets`` writes), memory-mapped."""

    def __init__(self, path: str) -> None:
        import pyarrow as pa

        self.source = pa.memory_map(path)
        try:
            self.reader = pa.ipc.open_file(self.source)
        except pa.ArrowInvalid:
            self.source.seek(0)
            self.reader = pa.ipc.open_stream(self.source)

    def __enter__(self):  # noqa: ANN204
        return self.reader

    def __exit__(self, *_: object) -> None:
        self.source.close()


def _arrow_batches(reader) -> Iterator:  # noqa: ANN001
    """The record batches of an IPC file reader or stream reader."""
    if hasattr(reader, "num_record_batches"):
        return (reader.get_batch(index) for index in range(reader.num_record_batches))
    return iter(reader)


def _read_file(path: str, field: str, start: int, stop: int, key: str) -> Iterator[str]:
    """Documents ``start`` to ``stop - 1`` of one file."""
    if path.endswith(".txt"):
        with open(path, encoding="utf-8", errors="strict") as handle:
            yield handle.read()
        return
    if path.endswith(".jsonl"):
        yield from _read_lines(path, field, start, stop, key)
        return
    yield from _read_columns(path, field, start, stop)


def _read_lines(path: str, field: str, start: int, stop: int, key: str) -> Iterator[str]:
    """The ``field`` strings of non-blank lines ``start`` to ``stop - 1`` (earlier lines are skipped unparsed)."""
    index = 0
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            if index >= start:
                yield _line_text(line, field, path, number, key)
            index += 1
            if index >= stop:
                return


def _read_columns(path: str, field: str, start: int, stop: int) -> Iterator[str]:
    """Rows ``start`` to ``stop - 1`` of a column, one record batch at a time; Parquet row groups and Arrow
    batches before ``start`` are skipped by their row counts alone."""
    import pyarrow.parquet as pq

    if path.endswith(".parquet"):
        parquet = pq.ParquetFile(path)
        offset, groups = 0, []
        for group in range(parquet.num_row_groups):
            rows = parquet.metadata.row_group(group).num_rows
            if offset + rows > start and offset < stop:
                groups.append(group)
            elif not groups:
                offset += rows
        batches = parquet.iter_batches(columns=[field], row_groups=groups) if groups else iter(())
        yield from _rows(batches, field, start - offset, stop - offset)
        return
    with _open_arrow(path) as reader:
        yield from _rows(_arrow_batches(reader), field, start, stop)


def _rows(batches: Iterator, field: str, start: int, stop: int) -> Iterator[str]:
    """Rows ``start`` to ``stop - 1`` of ``field`` over consecutive record batches (a missing value reads as "")."""
    offset = 0
    for batch in batches:
        rows = batch.num_rows
        if offset + rows > start:
            column = batch.column(batch.schema.get_field_index(field))
            first, last = max(start - offset, 0), min(stop - offset, rows)
            for value in column.slice(first, last - first).to_pylist():
                yield value or ""
        offset += rows
        if offset >= stop:
            return


def _line_text(line: str, field: str, path: str, number: int, key: str) -> str:
    """The string under ``field`` of one JSON line; ConfigError naming the source's field or path otherwise."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ConfigError(key, path, f"one JSON object per line; line {number}: {err}") from None
    text = record.get(field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        found = (f"holds a {type(record).__name__}" if not isinstance(record, dict) else
                 "holds no such key" if field not in record else f"holds a {type(text).__name__} there")
        raise ConfigError(f"{key.rsplit('.', 1)[0]}.field", field,
                          f"a key whose value is a string on every line of {path}; line {number} {found}")
    return text
