"""The user's chat rows as conversations: ``.jsonl`` lines and Parquet rows holding either a list of messages
(``{"role": ..., "content": ...}``) or a prompt and a response, read one row at a time (Parquet by record batch,
never a whole file at once)."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from disttrain.data.documents import check_files, json_object
from disttrain.errors import ConfigError

EXTENSIONS = (".jsonl", ".parquet")
"""The file kinds ``data.files`` may name for chat data."""

FILES_ALLOWED = "a list of existing .jsonl files (one JSON object per line) and .parquet files (one row each)"

ROLES = ("system", "user", "assistant")
"""The roles a message may have."""

PARQUET_BATCH_ROWS = 1024
"""Rows of a Parquet file read at once: a record batch, so a large file is never held whole."""

Conversation = list[dict[str, str]]
"""Messages in order, each ``{"role": ..., "content": ...}``."""


@dataclass(frozen=True)
class RowFields:
    """Where a row keeps its conversation."""

    messages: str
    """Key of the list of messages."""
    prompt: str
    """Key of the user's prompt (a row without messages)."""
    response: str
    """Key of the assistant's response (a row without messages)."""


def check_chat_files(files: Sequence[str]) -> list[str]:
    """The absolute paths of ``files``; ConfigError naming ``data.files`` if the list is empty, a file is missing
    or its extension is neither ``.jsonl`` nor ``.parquet``."""
    return check_files(files, EXTENSIONS, FILES_ALLOWED)


def read_conversations(path: str, fields: RowFields) -> Iterator[Conversation]:
    """Every row of one file as a conversation, in order; ConfigError (one line: the key, the file, the row) for
    a row that is not an object, holds neither form, or whose messages are not what ``conversation`` accepts."""
    rows = _parquet_rows(path, fields) if path.endswith(".parquet") else _jsonl_rows(path)
    for number, row in rows:
        yield conversation(row, fields, path, number)


def conversation(row: dict[str, Any], fields: RowFields, path: str, number: int) -> Conversation:
    """The messages of row ``number`` of ``path``: its ``fields.messages`` list, else its prompt as the user's
    message and its response as the assistant's. Each message needs a known role and string content, and one at
    least must be the assistant's (the loss is computed on nothing else)."""
    where = f"row {number} of {path}"
    if row.get(fields.messages) is not None:
        messages = row[fields.messages]
        if not isinstance(messages, list) or not messages:
            raise ConfigError("data.messages_key", fields.messages,
                              f"the key of a non-empty list of {{role, content}} messages; {where} holds a "
                              f"{type(messages).__name__} there")
        turns = [_message(message, index, fields, path, where) for index, message in enumerate(messages)]
    elif isinstance(row.get(fields.prompt), str) and isinstance(row.get(fields.response), str):
        turns = [{"role": "user", "content": row[fields.prompt]},
                 {"role": "assistant", "content": row[fields.response]}]
    else:
        raise ConfigError("data.messages_key", fields.messages,
                          f"a key every row holds (a list of messages), or string fields data.prompt_key="
                          f"'{fields.prompt}' and data.response_key='{fields.response}'; {where} holds neither "
                          f"(its keys: {sorted(row)[:10]})")
    if not any(turn["role"] == "assistant" for turn in turns):
        raise ConfigError("data.files", path, f"conversations with at least one assistant message (the loss is on "
                                              f"those); {where} has none")
    return turns


def _message(message: Any, index: int, fields: RowFields, path: str, where: str) -> dict[str, str]:
    """One message as ``{"role", "content"}``, checked."""
    if not isinstance(message, dict) or not isinstance(message.get("content"), str):
        raise ConfigError("data.messages_key", fields.messages,
                          f"the key of a list of messages that are objects with a string 'content'; message "
                          f"{index} of {where} is {json.dumps(message, default=str)[:80]}")
    role = message.get("role")
    if role not in ROLES:
        raise ConfigError("data.files", path, f"messages whose role is one of {', '.join(ROLES)}; message {index} "
                                              f"of {where} has role {json.dumps(role, default=str)}")
    return {"role": role, "content": message["content"]}


def _jsonl_rows(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` of each non-blank line."""
    try:
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield number, json_object(line, path, number)
    except UnicodeDecodeError as err:
        raise ConfigError("data.files", path, f"UTF-8 text: {err}") from None




def _parquet_rows(path: str, fields: RowFields) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(row number from 1, row)`` of a Parquet file, read a record batch at a time and only the columns that
    ``fields`` name."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError("data.files", path, "usable once pyarrow is installed "
                                              "(pip install 'disttrain[finetune]')") from None
    try:
        table = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises its own error types for a file that is not Parquet
        raise ConfigError("data.files", path, f"a readable Parquet file: {err}") from None
    columns = [name for name in (fields.messages, fields.prompt, fields.response) if name in table.schema_arrow.names]
    if not columns:
        raise ConfigError("data.messages_key", fields.messages,
                          f"a column of every Parquet file (a list of messages), or columns data.prompt_key="
                          f"'{fields.prompt}' and data.response_key='{fields.response}'; {path} has neither "
                          f"(its columns: {table.schema_arrow.names[:10]})")
    number = 0
    for batch in table.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=columns):
        for row in batch.to_pylist():
            number += 1
            yield number, row
