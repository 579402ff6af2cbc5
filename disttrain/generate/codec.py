"""Text to the data's tokens and back: UTF-8 bytes for byte-level data, else the data's tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from disttrain.data.spec import DataSpec
from disttrain.errors import ConfigError

TOKENIZER_FILE = "tokenizer.json"
"""The ``tokenizers`` file inside a data set's ``tokenizer`` folder."""


class Codec(Protocol):
    """How text becomes token ids and token ids text."""

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text``."""

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``."""


class ByteCodec:
    """Tokens are the bytes of UTF-8 text (vocabulary 256)."""

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """``ids`` as UTF-8, with a replacement character where the bytes are not valid UTF-8."""
        return bytes(ids).decode("utf-8", errors="replace")


class TokenizerCodec:
    """Tokens of a ``tokenizers`` tokenizer saved as ``tokenizer.json``."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(path))
        """The tokenizer the data set was tokenised with."""

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` as running text (no special tokens added: a prompt continues a text)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids``, without special tokens."""
        return self.tokenizer.decode(ids)


def codec_for(data: Any, spec: DataSpec) -> Codec:
    """The codec of the typed data config ``data``: its ``tokenizer`` folder where it has one, UTF-8 bytes where
    it declares ``TEXT_ENCODING``; ConfigError for data that is not text or has no way back to text."""
    name = getattr(data, "name", type(data).__name__)
    if spec.kind != "text":
        raise ConfigError("data.name", name, f"text data to generate from (this run's data is {spec.kind})")
    folder = getattr(data, "tokenizer", None)
    if folder is not None:
        path = Path(folder).expanduser() / TOKENIZER_FILE
        if not path.is_file():
            raise ConfigError("data.tokenizer", folder, f"a folder with {TOKENIZER_FILE} (there is no {path})")
        return TokenizerCodec(path)
    if getattr(data, "TEXT_ENCODING", None) == "utf-8" and spec.vocab_size == 256:
        return ByteCodec()
    raise ConfigError("data.name", name, "byte-level text (e.g. pydocs) or a data set with a data.tokenizer "
                      "folder: its token ids have no text to turn into")
