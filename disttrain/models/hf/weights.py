"""A Hugging Face folder's safetensors weights: which files hold them, and whether their headers fit a model.

``model.pretrained=true`` reads these files inside every rank, after the model is laid out; a file cut short, a
header that is not one, or a tensor of another shape would fail there, in every rank. ``check_weights`` reads
only the files' headers (names, shapes, dtypes, and that the data they describe fills the file) against the
model built on the meta device, so the job refuses such a folder in one line before any rank starts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from disttrain.errors import ConfigError
from disttrain.models.hf.conversion import conversion_of, saved_sources
from disttrain.models.lora import has_adapters, is_adapter

WEIGHTS_FILE = "model.safetensors"
"""The weights of a Hugging Face folder saved in one file."""
INDEX_FILE = "model.safetensors.index.json"
"""The index of a folder whose weights are sharded: its ``weight_map`` names the file of each tensor."""
HEADER_LIMIT = 100_000_000
"""The largest header safetensors reads (its own limit): a longer one is not a header."""
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2")
"""The safetensors dtypes a floating-point tensor of the model is read from (the reader casts them)."""


def weight_files(folder: Path, key: str = "model.path") -> list[Path]:
    """The safetensors files of ``folder``: ``model.safetensors``, else the shards its index names; empty when it
    has neither. ConfigError (on ``key``) for an index that is not JSON, has no ``weight_map``, or names a file
    the folder lacks."""
    single = folder / WEIGHTS_FILE
    if single.is_file():
        return [single]
    index = folder / INDEX_FILE
    if not index.is_file():
        return []
    try:
        index_json = json.loads(index.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(key, str(folder), f"a folder whose {INDEX_FILE} is JSON; it is not ({err})") from None
    shards = index_json.get("weight_map") if isinstance(index_json, dict) else None
    if not isinstance(shards, dict) or not all(isinstance(name, str) for name in shards.values()):
        found = ("it has none" if shards is None else f"its weight_map is a {type(shards).__name__}"
                 if not isinstance(shards, dict) else "its weight_map names something other than a file")
        raise ConfigError(key, str(folder), f"a folder whose {INDEX_FILE} has a weight_map (tensor name -> "
                          f"safetensors file); {found}")
    files = sorted(set(shards.values()))
    absent = [name for name in files if not (folder / name).is_file()]
    if absent:
        raise ConfigError(key, str(folder), f"a folder holding every file its {INDEX_FILE} names; {absent[0]} is "
                          f"not there{f' (nor {len(absent) - 1} more)' if len(absent) > 1 else ''}")
    return [folder / name for name in files]


def saved_headers(files: list[Path], key: str, folder: str) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """Each tensor the files hold: its file, shape and safetensors dtype, read from the headers alone.
    ConfigError (on ``key``, showing ``folder``) for a file that safetensors refuses to open."""
    from safetensors import SafetensorError, safe_open

    found: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for path in files:
        try:
            # opening checks the header and that its data offsets cover the file exactly (no tensor is read)
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():
                    saved = handle.get_slice(name)
                    found[name] = (path, tuple(saved.get_shape()), saved.get_dtype())
        except SafetensorError as err:
            raise ConfigError(key, folder, f"whole safetensors files; {path.name} {_why(path, err)}") from None
    return found


def _why(path: Path, err: Exception) -> str:
    """What is wrong with a file safetensors refused, in its sizes where the header is readable."""
    size = path.stat().st_size
    end = _header_end(path, size)
    if end is not None and end != size:
        return (f"is {size} bytes where its header's tensors end at byte {end} "
                f"({'cut short' if end > size else 'bytes past the last tensor'})")
    return f"is not a safetensors file ({str(err).strip()})"


def _header_end(path: Path, size: int) -> int | None:
    """The byte at which a safetensors file's last tensor ends, by its own header; None if the header does not
    parse. (safetensors' error says only that the data does not cover the file, not by how much.)"""
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


def check_weights(net: Any, folder: str, key: str = "model.path") -> None:
    """``folder``'s safetensors headers hold every tensor of ``net`` (a model built on the meta device, whose
    parameters and persistent buffers the folder replaces) at the model's shape and in a dtype it casts from: under
    its own name, or, for a Hugging Face model, in a layout ``transformers`` converts from (per-expert tensors of a
    mixture, ``disttrain.models.hf.conversion``). A weight tied to one the folder holds may be absent (a head
    sharing the token embedding is saved once). ConfigError on ``key`` naming the file, the tensor, what the file
    holds and what the model needs."""
    files = weight_files(Path(folder), key)
    if not files:
        raise ConfigError(key, folder, f"a folder with {WEIGHTS_FILE} or its shards and {INDEX_FILE}")
    saved = saved_headers(files, key, folder)
    groups: dict[int, list[str]] = {}  # a tied weight is one tensor under several names
    state = net.state_dict(keep_vars=True)
    if has_adapters(net):  # adapters start from their own initialisation, not from the folder
        state = {name: tensor for name, tensor in state.items() if not is_adapter(name)}
    for name, tensor in state.items():
        groups.setdefault(id(tensor), []).append(name)
    try:
        sources = saved_sources(state, saved, conversion_of(net))
    except ValueError as err:
        raise ConfigError(key, folder, f"weights of this model; {err}") from None
    missing = [names[0] for names in groups.values() if not any(name in sources for name in names)]
    if missing:
        more = f" (nor {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(key, folder, f"weights of this model; no file of the folder holds {missing[0]}{more}")
    for name, tensor in state.items():
        if name not in sources:
            continue
        source = sources[name]
        leaves = source.leaves()
        held = (f"{source.path.name} holds {source.name}" + (f" (the model's {name})" if source.name != name else "")
                if leaves == [source] else
                f"the folder's {leaves[0].name}{f' (and {len(leaves) - 1} more)' if len(leaves) > 1 else ''} "
                f"give {name}")
        if tuple(source.shape) != tuple(tensor.shape):
            raise ConfigError(key, folder, f"weights of this model; {held} as {list(source.shape)}, where the "
                              f"model's is {list(tensor.shape)}")
        for leaf in leaves:
            if not _casts(leaf.dtype, tensor.dtype):
                allowed = "one of " + ", ".join(FLOAT_DTYPES) if tensor.is_floating_point() else "the same"
                raise ConfigError(key, folder, f"weights of this model; {leaf.path.name} holds {leaf.name} as "
                                  f"{leaf.dtype}, which does not cast to the model's "
                                  f"{str(tensor.dtype).removeprefix('torch.')} ({allowed})")


def _casts(saved: str, dtype: torch.dtype) -> bool:
    """Whether a saved tensor of safetensors dtype ``saved`` is read into one of ``dtype``: a floating-point
    tensor from any floating-point dtype; any other only from its own."""
    if dtype.is_floating_point:
        return saved in FLOAT_DTYPES
    own = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32",
           torch.int64: "I64"}
    return own.get(dtype) == saved


def check_starting_weights(net: Any) -> None:
    """The folder ``net`` starts from (its ``pretrained()``, when it declares one that names a folder) fits it, as
    ``check_weights`` checks."""
    starting_weights = getattr(net, "pretrained", None)
    folder = starting_weights() if callable(starting_weights) else None
    if folder is not None:
        check_weights(net, folder)
