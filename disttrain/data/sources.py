"""One source of a mixture: a path or glob of ``.parquet``, ``.arrow``, ``.jsonl`` and ``.txt`` files, or a folder
written by ``datasets.Dataset.save_to_disk``, read as a sequence of documents (the strings of one field).

Documents are numbered across the source's files in sorted order. ``scan_file`` reads every document of a file once,
checking each (every Parquet page, every JSON line), for the source's length index; ``DocumentReader`` then reads
any document by its number: a JSON line by its byte offset, a Parquet row from its row group, an Arrow row from its
record batch of a memory map. No source is ever held whole in memory. Files are read with pyarrow and the standard
library alone: no pickle, no code from the files.
"""

from __future__ import annotations

import bisect
import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

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


def source_files(key: str, pattern: str) -> tuple[str, ...]:
    """The files of a path, glob or saved dataset folder, sorted; ConfigError naming ``key`` when there are none."""
    path = os.path.abspath(os.path.expanduser(pattern))
    if os.path.isdir(path):
        return tuple(_saved_dataset_files(key, path))
    names = sorted(glob.glob(path)) if glob.has_magic(path) else [path] if os.path.exists(path) else []
    if not names:
        raise ConfigError(key, pattern, f"{SOURCE_ALLOWED}; nothing exists there")
    for name in names:
        if not name.endswith(EXTENSIONS) or not os.path.isfile(name):
            raise ConfigError(key, pattern, f"{SOURCE_ALLOWED}; {name} is not one")
    return tuple(names)


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


def scan_file(path: str, field: str, key: str) -> Iterator[tuple[str, int]]:
    """Every document of one file with the byte offset of its line (JSON lines; 0 for other kinds), each read and
    checked: ConfigError naming ``key`` and the file for a page that does not decode, a line that is not a JSON
    object holding a string under ``field`` (the key ``data.sources[i].field`` then), or text that is not UTF-8."""
    if path.endswith(".txt"):
        try:
            with open(path, encoding="utf-8", errors="strict") as handle:
                yield handle.read(), 0
        except UnicodeDecodeError as err:
            raise ConfigError(key, path, f"UTF-8 text: {err}") from None
        return
    if path.endswith(".jsonl"):
        yield from _scan_lines(path, field, key)
        return
    _check_column(path, field, key)
    import pyarrow as pa

    try:
        for batch in _record_batches(path, field):
            for value in batch.column(batch.schema.get_field_index(field)).to_pylist():
                yield value or "", 0
    except (pa.ArrowException, OSError, UnicodeDecodeError) as err:
        kind = "Parquet" if path.endswith(".parquet") else "Arrow"
        raise ConfigError(key, path, f"a readable {kind} file whose every page decodes: {err}") from None


def _scan_lines(path: str, field: str, key: str) -> Iterator[tuple[str, int]]:
    """The ``field`` string of every non-blank line of a JSON-lines file, with the line's byte offset."""
    offset = 0
    with open(path, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ConfigError(key, path, f"UTF-8 text; line {number}: {err}") from None
            if line.strip():
                yield _line_text(line, field, path, f"line {number}", key), offset
            offset += len(raw)


def _check_column(path: str, field: str, key: str) -> None:
    """A Parquet file's footer or an Arrow file's schema names ``field`` as a string column."""
    import pyarrow as pa

    schema = _arrow_schema(path, key)
    field_key = f"{key.rsplit('.', 1)[0]}.field"
    if field not in schema.names:
        raise ConfigError(field_key, field, f"a column of {path}; its columns: {schema.names[:10]}")
    column_type = schema.field(field).type
    if not (pa.types.is_string(column_type) or pa.types.is_large_string(column_type)):
        raise ConfigError(field_key, field, f"a string column of {path}; it holds {column_type}")


def _arrow_schema(path: str, key: str) -> Any:
    """Schema of a Parquet file (its footer) or an Arrow file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.endswith(".parquet"):
            return pq.ParquetFile(path).metadata.schema.to_arrow_schema()
        with _open_arrow(path) as reader:
            return reader.schema
    except (pa.ArrowException, OSError) as err:
        kind = "Parquet" if path.endswith(".parquet") else "Arrow"
        raise ConfigError(key, path, f"a readable {kind} file: {err}") from None


def _record_batches(path: str, field: str) -> Iterator[Any]:
    """The record batches of ``field`` in a Parquet file (pages checked against their checksums where the file
    has them) or an Arrow file."""
    import pyarrow.parquet as pq

    if path.endswith(".parquet"):
        yield from pq.ParquetFile(path, page_checksum_verification=True).iter_batches(columns=[field])
        return
    with _open_arrow(path) as reader:
        yield from _arrow_batches(reader)


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


class DocumentReader:
    """Any document of a source by its number, reading only what holds it: a JSON line from its byte offset
    (``line_offsets``: per document of the source, from its length index), a Parquet row group's column (the last
    one read is kept), a record batch of a memory-mapped Arrow file, a text file."""

    def __init__(self, source: SourceFiles, line_offsets: np.ndarray) -> None:
        self.source, self.line_offsets = source, line_offsets
        self._firsts = np.cumsum((0, *source.counts)).tolist()
        self._lines: dict[int, BinaryIO] = {}
        self._columnar: dict[int, tuple[Any, list[int]]] = {}
        self._column: tuple[tuple[int, int], Any] | None = None
        """The last Parquet row group read: ``((file, group), its column)``."""

    def text(self, index: int) -> str:
        """The text of document ``index`` of the source."""
        number = bisect.bisect_right(self._firsts, index) - 1
        path, row = self.source.files[number], index - self._firsts[number]
        if path.endswith(".txt"):
            with open(path, encoding="utf-8", errors="strict") as handle:
                return handle.read()
        if path.endswith(".jsonl"):
            if number not in self._lines:
                self._lines[number] = open(path, "rb")  # noqa: SIM115 (kept open while the reader lives)
            handle = self._lines[number]
            handle.seek(int(self.line_offsets[index]))
            return _line_text(handle.readline().decode("utf-8"), self.source.field, path, f"document {row}",
                              self.source.key)
        opened, firsts = self._opened(number)
        part = bisect.bisect_right(firsts, row) - 1
        if path.endswith(".parquet"):
            if self._column is None or self._column[0] != (number, part):
                self._column = ((number, part), opened.read_row_group(part, columns=[self.source.field]).column(0))
            column = self._column[1]
        else:
            batch = opened[1][part]
            column = batch.column(batch.schema.get_field_index(self.source.field))
        return column[row - firsts[part]].as_py() or ""

    def _opened(self, number: int) -> tuple[Any, list[int]]:
        """A columnar file kept open: the ``ParquetFile``, or the Arrow memory map and its record batches; and the
        first row of each row group or batch."""
        if number not in self._columnar:
            import pyarrow.parquet as pq

            path = self.source.files[number]
            if path.endswith(".parquet"):
                opened: Any = pq.ParquetFile(path, page_checksum_verification=True)
                rows = [opened.metadata.row_group(group).num_rows for group in range(opened.num_row_groups)]
            else:
                mapped = _open_arrow(path)
                batches = list(_arrow_batches(mapped.reader))  # views of the memory map, not copies
                opened, rows = (mapped, batches), [batch.num_rows for batch in batches]
            self._columnar[number] = (opened, np.cumsum((0, *rows)).tolist())
        return self._columnar[number]

    def close(self) -> None:
        """Close the files held open."""
        for handle in self._lines.values():
            handle.close()
        for opened, _ in self._columnar.values():
            if isinstance(opened, tuple):
                opened[0].source.close()
        self._lines, self._columnar, self._column = {}, {}, None


def _line_text(line: str, field: str, path: str, where: str, key: str) -> str:
    """The string under ``field`` of one JSON line; ConfigError naming the source's field or path otherwise."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ConfigError(key, path, f"one JSON object per line; {where}: {err}") from None
    text = record.get(field) if isinstance(record, dict) else None
    if not isinstance(text, str):
        found = (f"holds a {type(record).__name__}" if not isinstance(record, dict) else
                 "holds no such key" if field not in record else f"holds a {type(text).__name__} there")
        raise ConfigError(f"{key.rsplit('.', 1)[0]}.field", field,
                          f"a key whose value is a string on every line of {path}; {where} {found}")
    return text
