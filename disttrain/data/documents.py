"""The user's text files as documents: a ``.txt`` file is one document, a ``.jsonl`` file one per line."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

from disttrain.errors import ConfigError

EXTENSIONS = (".txt", ".jsonl")
"""The file kinds ``data.files`` may name."""

FILES_ALLOWED = "a list of existing .txt files (one document each) and .jsonl files (one JSON object per line)"


def check_files(files: Sequence[str], extensions: tuple[str, ...] = EXTENSIONS,
                allowed: str = FILES_ALLOWED) -> list[str]:
    """The absolute paths of ``files``; ConfigError naming ``data.files`` (with ``allowed``) if the list is empty,
    a file is missing or its extension is none of ``extensions`` (by default ``.txt`` and ``.jsonl``)."""
    if not files:
        raise ConfigError("data.files", list(files), allowed)
    paths = []
    for name in files:
        path = os.path.abspath(os.path.expanduser(name))
        if not path.endswith(extensions):
            raise ConfigError("data.files", list(files), f"{allowed}; {name} is neither")
        if not os.path.isfile(path):
            raise ConfigError("data.files", list(files), f"{allowed}; {name} does not exist")
        paths.append(path)
    return paths


def read_documents(path: str, text_key: str) -> Iterator[str]:
    """The documents of one file: a ``.txt`` file's whole text, or the ``text_key`` string of each non-blank
    line of a ``.jsonl`` file. ConfigError on text that is not UTF-8, a line that is not a JSON object, or
    one without a string under ``text_key``."""
    try:
        with open(path, encoding="utf-8") as handle:
            if path.endswith(".txt"):
                yield handle.read()
                return
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield _line_text(line, text_key, path, number)
    except UnicodeDecodeError as err:
        raise ConfigError("data.files", path, f"UTF-8 text: {err}") from None


def json_object(line: str, path: str, number: int) -> dict[str, Any]:
    """Line ``number`` of the ``.jsonl`` file ``path`` parsed as a JSON object; ConfigError naming ``data.files``
    where it is not valid JSON or not an object."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ConfigError("data.files", path, f"one JSON object per line; line {number}: {err}") from None
    if not isinstance(record, dict):
        raise ConfigError("data.files", path, f"one JSON object per line; line {number} holds a "
                                              f"{type(record).__name__}")
    return record


def _line_text(line: str, text_key: str, path: str, number: int) -> str:
    """The string under ``text_key`` of one JSON line."""
    record = json_object(line, path, number)
    text = record.get(text_key)
    if not isinstance(text, str):
        found = "holds no such key" if text_key not in record else f"holds a {type(text).__name__} there"
        raise ConfigError("data.text_key", text_key,
                          f"a key whose value is a string on every line of {path}; line {number} {found} "
                          f"(its keys: {sorted(record)[:10]})")
    return text
