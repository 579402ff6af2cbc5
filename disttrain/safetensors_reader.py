"""The one reader of safetensors files: a file's headers, its tensors, a part of one tensor, a Hugging Face folder's
files. safetensors holds a JSON header and raw bytes, so nothing read here ever runs code from the file.

Every read of starting weights goes through it: ``model.init_weights`` (``disttrain.checkpoint.init_weights``),
``model.pretrained=true`` (``disttrain.models.hf.weights`` checks the headers, ``disttrain.parallel.pretrained``
reads each rank's part), llama's ``model.init_from`` (``disttrain.models.llama_hf``). A refusal is one line naming
the file and what is wrong with it (cut short by how many bytes, not safetensors, an index that is not JSON, has no
``weight_map`` or names a missing file), raised as the caller's own error: the caller decides once who the user
set the file through and hands that down as a value (``Refuse``) with the path, inside a ``SafetensorsFile`` or
``SafetensorsFolder``, so every later read, on the job or on a rank, refuses in the same words. Whether the tensors
read fit a model is a rule of its own, ``disttrain.models.weights_fit``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from disttrain.errors import ConfigError

WEIGHTS_FILE = "model.safetensors"
"""The weights of a Hugging Face folder saved in one file."""
INDEX_FILE = "model.safetensors.index.json"
"""The index of a folder whose weights are sharded: its ``weight_map`` names the file of each tensor."""
HEADER_LIMIT = 100_000_000
"""The largest header safetensors reads (its own limit): a longer one is not a header."""

Box = tuple[tuple[int, int], ...]
"""A region of a tensor: ``(start, stop)`` on each of its dims."""

Refuse = Callable[[str], Exception]
"""How a refusal reaches the user: given one line naming the file and what is wrong with it, the caller's
exception (a ``ConfigRefusal`` for a file a config key names; ``partial(CheckpointReadError, checkpoint)`` where a
checkpoint is read)."""


@dataclass(frozen=True)
class ConfigRefusal:
    """A refusal as ``ConfigError`` on the config key that named the file or folder:
    ``{key}={value} is invalid: {wanted}; {what is wrong}``."""

    key: str
    """The config key (``model.path``, ``model.init_weights``)."""
    value: object
    """Its value, as the user set it."""
    wanted: str
    """What the key must name (``a folder of this model's safetensors weights``)."""

    def __call__(self, problem: str) -> ConfigError:
        """The ``ConfigError`` saying ``problem`` (one line naming the file)."""
        return ConfigError(self.key, self.value, f"{self.wanted}; {problem}")


class TensorHeader(NamedTuple):
    """One tensor as a safetensors header describes it (no byte of it read)."""

    file: SafetensorsFile
    """The file holding it."""
    shape: tuple[int, ...]
    """Its shape."""
    dtype: str
    """Its safetensors dtype (``F32``, ``BF16``, ...)."""


@dataclass(frozen=True)
class SafetensorsFile:
    """One safetensors file and how a refusal to read it is raised."""

    path: Path
    """The file."""
    refuse: Refuse = field(repr=False, compare=False)
    """The caller's refusal (see ``Refuse``)."""

    def headers(self) -> dict[str, TensorHeader]:
        """Each tensor the file holds, from its header alone; a refusal where the file is missing or is not a whole
        safetensors file (a pickle, a ``torch.save`` archive, a file cut short or with bytes past its tensors)."""
        found: dict[str, TensorHeader] = {}
        with self._opened() as handle:
            for name in handle.keys():
                saved = handle.get_slice(name)
                found[name] = TensorHeader(self, tuple(saved.get_shape()), saved.get_dtype())
        return found

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the file, on the CPU; refused as :meth:`headers` says."""
        with self._opened() as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}

    def part(self, name: str, box: Box) -> torch.Tensor:
        """The ``box`` of tensor ``name``: the only bytes read (a rank's shard, slice or experts)."""
        from safetensors import SafetensorError

        # opened per read: the file is memory-mapped, and pages read stay resident until it is closed
        with self._opened() as handle:
            try:
                saved = handle.get_slice(name)
            except SafetensorError:
                raise self.refuse(f"{self.path.name} holds no tensor {name}") from None
            return saved[tuple(slice(start, stop) for start, stop in box)]

    def _opened(self) -> Any:
        """``safe_open`` of the file, which checks the header and that its data offsets cover the file exactly;
        a refusal naming the file where it cannot."""
        from safetensors import SafetensorError, safe_open

        if not self.path.is_file():
            raise self.refuse(f"{self.path.name} is not there" if not self.path.exists() else
                              f"{self.path.name} is not a file")
        try:
            return safe_open(str(self.path), framework="pt", device="cpu")
        except SafetensorError as err:
            raise self.refuse(f"{self.path.name} {_what_is_wrong(self.path, err)}") from None
        except OSError as err:
            why = f"{type(err).__name__}: {err.strerror or err}"
            raise self.refuse(f"{self.path.name} cannot be opened ({why})") from None


@dataclass(frozen=True)
class SafetensorsFolder:
    """A Hugging Face folder's safetensors weights (``model.safetensors``, or the shards its
    ``model.safetensors.index.json`` names) and how a refusal to read them is raised."""

    path: Path
    """The folder."""
    refuse: Refuse = field(repr=False, compare=False)
    """The caller's refusal (see ``Refuse``)."""

    def files(self) -> list[SafetensorsFile]:
        """Its files: ``model.safetensors``, else the shards its index names. A refusal where it has neither, or
        its index is not JSON, has no ``weight_map`` (tensor name -> file), or names a file the folder lacks."""
        single = self.path / WEIGHTS_FILE
        if single.is_file():
            return [SafetensorsFile(single, self.refuse)]
        index = self.path / INDEX_FILE
        if not index.is_file():
            raise self.refuse(f"it has neither {WEIGHTS_FILE} nor {INDEX_FILE}")
        try:
            index_json = json.loads(index.read_text())
        except (ValueError, UnicodeDecodeError) as err:
            raise self.refuse(f"its {INDEX_FILE} is not JSON ({err})") from None
        except OSError as err:
            raise self.refuse(f"its {INDEX_FILE} cannot be read ({type(err).__name__}: {err.strerror or err})") \
                from None
        shards = index_json.get("weight_map") if isinstance(index_json, dict) else None
        if not isinstance(shards, dict) or not all(isinstance(name, str) for name in shards.values()):
            found = ("has no weight_map" if shards is None else f"has a weight_map that is a {type(shards).__name__}"
                     if not isinstance(shards, dict) else "has a weight_map naming something other than a file")
            raise self.refuse(f"its {INDEX_FILE} {found} (a weight_map maps each tensor's name to its file)")
        names = sorted(set(shards.values()))
        absent = [name for name in names if not (self.path / name).is_file()]
        if absent:
            more = f" (nor {len(absent) - 1} more)" if len(absent) > 1 else ""
            raise self.refuse(f"its {INDEX_FILE} names {absent[0]}, which is not there{more}")
        return [SafetensorsFile(self.path / name, self.refuse) for name in names]

    def headers(self) -> dict[str, TensorHeader]:
        """Each tensor its files hold, from their headers alone; refused as :meth:`files` and
        :meth:`SafetensorsFile.headers` say."""
        return _read_headers(self.files())

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of its files, on the CPU; refused as :meth:`headers` says, before any tensor is read."""
        files = self.files()
        _read_headers(files)  # every file whole before the first is read: one refusal, not a half-read folder
        return {name: tensor for file in files for name, tensor in file.tensors().items()}


def _read_headers(files: Iterable[SafetensorsFile]) -> dict[str, TensorHeader]:
    """Each tensor ``files`` hold, from their headers alone (a tensor in two files: the later file's)."""
    return {name: header for file in files for name, header in file.headers().items()}


def _what_is_wrong(path: Path, err: Exception) -> str:
    """What is wrong with a file safetensors refused, in its sizes where the header is readable (safetensors' own
    error says only that the data does not cover the file, not by how much)."""
    size = path.stat().st_size
    end = _data_end(path, size)
    if end is not None and end > size:
        return f"is cut short by {end - size} bytes ({size} bytes, where its header's tensors end at byte {end})"
    if end is not None and end < size:
        return f"has {size - end} bytes past its last tensor ({size} bytes, where its header's tensors end at {end})"
    return f"is not a safetensors file ({' '.join(str(err).split())})"


def _data_end(path: Path, size: int) -> int | None:
    """The byte at which a safetensors file's last tensor ends, by its own header; None if the header does not
    parse."""
    with path.open("rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            return None
        length = int.from_bytes(prefix, "little")
        if length > min(size - 8, HEADER_LIMIT):
            return None
        try:
            header = json.loads(handle.read(length))
            ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
        except (ValueError, UnicodeDecodeError, KeyError, TypeError, IndexError, AttributeError):
            return None
    return 8 + length + max(ends, default=0) if all(isinstance(end, int) for end in ends) else None
