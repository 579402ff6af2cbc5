"""Reading checkpoint folders without letting a file run code.

A checkpoint folder holds ``meta.pt`` (Lightning's loop, callback and scheduler state), ``.metadata``
(torch.distributed.checkpoint's index) and the shards. ``torch.distributed.checkpoint`` reads
``.metadata`` with plain ``pickle.load`` and non-tensor items with ``torch.load(weights_only=False)``,
either of which runs whatever a crafted file asks for. Here ``meta.pt`` and non-tensor items load with
``weights_only=True``, and ``.metadata`` is first unpickled with an allow-list of the index's own classes.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.planner import ReadItem

METADATA_FILE = "meta.pt"
INDEX_FILE = ".metadata"
_INDEX_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"Path", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class UnsafeCheckpointError(ValueError):
    """A checkpoint file asks to build an object that a checkpoint never contains."""


class CheckpointReadError(ValueError):
    """A checkpoint folder could not be read; the message names the folder and the first rank's cause."""


@contextmanager
def reading(checkpoint: Path) -> Iterator[None]:
    """Turn torch.distributed.checkpoint's ``CheckpointException`` (a ``BaseException`` that carries each
    rank's error), or a refused index, into one ``CheckpointReadError`` naming the folder and the cause."""
    try:
        yield
    except CheckpointException as err:
        causes = [getattr(failure, "exception", failure) for failure in err.failures.values()]
        raise CheckpointReadError(f"{checkpoint} cannot be read: {causes[0] if causes else err}") from None
    except UnsafeCheckpointError as err:  # the index read outside torch's loader
        raise CheckpointReadError(f"{checkpoint} cannot be read: {err}") from None


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = name in _INDEX_CLASSES.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        if not allowed:
            raise UnsafeCheckpointError(f"the checkpoint index refers to {module}.{name}, which a "
                                        "torch.distributed.checkpoint index never holds; refusing to load it")
        return super().find_class(module, name)


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that checks ``.metadata`` against the allow-list before torch unpickles it."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """The checkpoint's index, after an allow-listed unpickling of the same file."""
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as stream:
            _IndexUnpickler(io.BytesIO(stream.read())).load()
        return super().read_metadata(*args, **kwargs)


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads non-tensor items (hyper-parameters) with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """As torch's, but a stored object may only be plain data."""
        from torch.distributed.checkpoint._nested_dict import set_element

        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def load_metadata(checkpoint: Path) -> dict[str, Any]:
    """Lightning's ``meta.pt`` of a checkpoint folder (plain data and tensors only)."""
    return torch.load(Path(checkpoint) / METADATA_FILE, weights_only=True)


def load_index(checkpoint: Path) -> Any:
    """torch.distributed.checkpoint's index (``.metadata``) of a folder, unpickled through the allow-list."""
    return _IndexUnpickler(io.BytesIO((Path(checkpoint) / INDEX_FILE).read_bytes())).load()


def load_sharded(state: dict[str, Any], checkpoint: Path) -> None:
    """``torch.distributed.checkpoint.load`` of ``state`` in place from ``checkpoint``, safely."""
    import torch.distributed.checkpoint as dcp

    with reading(checkpoint):
        dcp.load(state, storage_reader=SafeFileSystemReader(str(checkpoint)), planner=SafeLoadPlanner(),
                 no_dist=one_process())


def one_process() -> bool:
    """No other rank shares this checkpoint: it is planned without collectives. Given a one-rank group,
    torch.distributed.checkpoint gathers its plan on gloo's own threads anyway, whose copies start OpenMP thread
    teams of their own; with more torch threads than one, every later training step of the digits CNN then ran
    1.7x slower (10.2 -> 17.7 ms with 2 threads on 2 cores, from the first checkpoint on).

    Where it answers yes, torch's notice that it saves or loads in a single process (printed at every run's first
    save and load) is hidden, for the whole process: an asynchronous save plans on a thread of its own after the
    call returns."""
    alone = not (dist.is_initialized() and dist.get_world_size() > 1)
    if alone:
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    return alone


def saved_shapes(checkpoint: Path) -> dict[str, tuple[int, ...]]:
    """The full shape of each model tensor a checkpoint folder holds, by its name in the model (e.g.
    ``embed.wte.weight``), read from the index alone (the first replica's where replicas were kept apart)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for key, meta in load_index(checkpoint).state_dict_metadata.items():
        for prefix in ("state_dict.net.", "replica0.state_dict.net."):
            if key.startswith(prefix) and hasattr(meta, "size"):
                shapes.setdefault(key[len(prefix):], tuple(meta.size))
    return shapes
