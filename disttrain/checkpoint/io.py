"""The one reader of checkpoint folders: no file in one runs code, and a refusal is one line naming the file.

A checkpoint folder holds ``meta.pt`` (Lightning's loop, callback and scheduler state), ``.metadata``
(torch.distributed.checkpoint's index) and the shards. torch's own readers unpickle ``.metadata`` with plain
``pickle.load`` and non-tensor items with ``torch.load(weights_only=False)`` (``dcp.load``'s default planner and
``_load_state_dict_from_keys``'s alike), either of which runs whatever a crafted file asks for. Here ``.metadata``
is unpickled once, through an allow-list of the index's own classes, and ``meta.pt`` and every stored object load
with ``weights_only=True``. Every read of a checkpoint (resume, export, generation, the tests' helpers) goes
through the functions below. Safetensors files (a run's starting weights: ``model.init_weights``, a Hugging Face
folder) hold a JSON header and raw bytes, nothing that runs, and have a reader of their own below this package,
``disttrain.safetensors_reader``, which the models read through too.
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta
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
# torch's refusal of a weights-only load wraps the one line that says why in paragraphs of advice (one of them
# to load the file again with weights_only=False): only that line is kept
_TORCH_ADVICE = ("Weights only load failed", "Check the documentation", "Please file an issue")


class UnsafeCheckpointError(ValueError):
    """A checkpoint file asks to build an object that a checkpoint never contains."""


class CheckpointReadError(ValueError):
    """A checkpoint folder could not be read: one line naming the folder, then the file in it and the cause."""

    def __init__(self, checkpoint: Path | str, cause: str) -> None:
        self.checkpoint, self.cause = checkpoint, cause
        super().__init__(f"{checkpoint} cannot be read: {cause}")

    def __reduce__(self) -> tuple[type, tuple[Path | str, str]]:
        # rebuilt from its two parts, so it crosses process boundaries (a rank's error reaching the job)
        return type(self), (self.checkpoint, self.cause)


def _cause(err: BaseException) -> str:
    """One line saying why a file could not be read: the error's own line where torch wrapped it in advice."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    told = [line for line in lines if not line.startswith(_TORCH_ADVICE)]
    if told:
        return told[-1]
    return lines[0] if lines else type(err).__name__


@contextmanager
def reading(checkpoint: Path) -> Iterator[None]:
    """Turn torch.distributed.checkpoint's ``CheckpointException`` (a ``BaseException`` that carries each
    rank's error), or a refused file, into one ``CheckpointReadError`` naming the folder and the cause."""
    try:
        yield
    except CheckpointException as err:
        # each rank's failure is a pair (exception, stack): the first rank's exception says why
        causes = [failure[0] if isinstance(failure, tuple) else failure for failure in err.failures.values()]
        first = causes[0] if causes else err
        cause = str(first) if isinstance(first, UnsafeCheckpointError) else f"{type(first).__name__}: {_cause(first)}"
        raise CheckpointReadError(checkpoint, cause) from None
    except UnsafeCheckpointError as err:  # a file read outside torch's loader
        raise CheckpointReadError(checkpoint, str(err)) from None


def plain_data(source: Any, what: str) -> Any:
    """``torch.load(source, weights_only=True)``: tensors, containers and numbers only. ``UnsafeCheckpointError``
    naming ``what`` (the file, or the item and its file) where it asks for anything else or is no torch file."""
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as err:
        asks = "GLOBAL" in str(err)  # the weights-only unpickler met a class or function to call
        raise UnsafeCheckpointError(f"{what} {'is not plain data' if asks else 'is not a torch file of plain data'} "
                                    f"({_cause(err)}); refusing to load it") from None


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        allowed = name in _INDEX_CLASSES.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        if not allowed:
            raise UnsafeCheckpointError(f"its index {INDEX_FILE} refers to {module}.{name}, which a "
                                        "torch.distributed.checkpoint index never holds; refusing to load it")
        return super().find_class(module, name)


def _unpickle_index(data: bytes) -> Any:
    """The index in ``data``, through the allow-list; UnsafeCheckpointError for anything else."""
    try:
        index = _IndexUnpickler(io.BytesIO(data)).load()
    except UnsafeCheckpointError:
        raise
    except Exception as err:  # noqa: BLE001 - whatever garbage the file holds, it is no index
        raise UnsafeCheckpointError(f"its index {INDEX_FILE} is not a torch.distributed.checkpoint index "
                                    f"({type(err).__name__}: {_cause(err)})") from None
    if not hasattr(index, "state_dict_metadata"):
        raise UnsafeCheckpointError(f"its index {INDEX_FILE} holds a {type(index).__name__}, not a checkpoint index")
    return index


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is unpickled through the allow-list (and only so)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        """The checkpoint's index, unpickled once through the allow-list."""
        with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as stream:
            index = _unpickle_index(stream.read())
        if getattr(index, "storage_meta", None) is None:  # as torch's reader: older indexes carry none
            index.storage_meta = StorageMeta()
        index.storage_meta.load_id = self.load_id
        return index


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads non-tensor items (hyper-parameters) with ``weights_only=True``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """As torch's, but a stored object may only be plain data; the refusal names the item and its shard."""
        from torch.distributed.checkpoint._nested_dict import set_element

        fqn = read_item.dest_index.fqn
        shard = self.metadata.storage_data[read_item.storage_index].relative_path if self.metadata else "a shard"
        loaded = plain_data(value, f"its item {fqn} (in {shard})")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], loaded)
        else:
            self.state_dict[fqn] = loaded


def load_metadata(checkpoint: Path) -> dict[str, Any]:
    """Lightning's ``meta.pt`` of a checkpoint folder (plain data and tensors only); ``FileNotFoundError`` where
    there is none, ``CheckpointReadError`` where it is not plain data."""
    path = Path(checkpoint) / METADATA_FILE
    try:
        return plain_data(path, f"its {METADATA_FILE}")
    except UnsafeCheckpointError as err:
        raise CheckpointReadError(checkpoint, str(err)) from None


def load_index(checkpoint: Path) -> Any:
    """torch.distributed.checkpoint's index (``.metadata``) of a folder, unpickled through the allow-list;
    ``FileNotFoundError`` where there is none, ``CheckpointReadError`` where it is refused or garbage."""
    data = (Path(checkpoint) / INDEX_FILE).read_bytes()
    with reading(checkpoint):
        return _unpickle_index(data)


def load_sharded(state: dict[str, Any], checkpoint: Path) -> None:
    """``torch.distributed.checkpoint.load`` of ``state`` in place from ``checkpoint``, safely."""
    import torch.distributed.checkpoint as dcp

    with reading(checkpoint):
        dcp.load(state, storage_reader=SafeFileSystemReader(str(checkpoint)), planner=SafeLoadPlanner(),
                 no_dist=one_process())


def item_paths(index: Any) -> dict[str, tuple[Any, ...]]:
    """Each item's index name -> its place in the saved state (``state_dict.net.w`` -> ``("state_dict", "net.w")``)."""
    planned = getattr(index, "planner_data", None) or {}
    return {fqn: tuple(planned.get(fqn) or fqn.split(".")) for fqn in index.state_dict_metadata}


def load_items(checkpoint: Path, select: Callable[[tuple[Any, ...]], bool], index: Any = None
               ) -> dict[tuple[Any, ...], Any]:
    """Every item of a checkpoint whose place (see :func:`item_paths`) ``select`` accepts, read whole into this
    process (every rank's shards of a tensor joined), by place: what export and generation consolidate, without a
    model to load into. Tensors are read as torch reads them; other items as plain data only."""
    checkpoint = Path(checkpoint)
    index = load_index(checkpoint) if index is None else index
    places = {fqn: path for fqn, path in item_paths(index).items() if select(path)}
    check_shards(checkpoint, index)
    # a flat template keyed by the index's own names: planned as saved, without rebuilding the nesting
    template = {fqn: None if isinstance(meta, BytesStorageMetadata) else
                torch.empty(meta.size, dtype=meta.properties.dtype)
                for fqn, meta in index.state_dict_metadata.items() if fqn in places}
    if template:
        load_sharded(template, checkpoint)
    return {places[fqn]: value for fqn, value in template.items()}


def check_shards(checkpoint: Path, index: Any) -> None:
    """``CheckpointReadError`` naming the shard where one that ``index`` names is missing or shorter than the
    extents it records (a full disk, a copy cut short)."""
    needed: dict[str, int] = {}
    for info in (index.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in needed.items():
        path = Path(checkpoint) / name
        if not path.is_file():
            raise CheckpointReadError(checkpoint, f"its shard {name} is missing")
        if path.stat().st_size < size:
            raise CheckpointReadError(checkpoint, f"its shard {name} holds {path.stat().st_size} bytes, its index "
                                      f"needs {size}")


def check_checkpoint(checkpoint: Path) -> None:
    """``CheckpointReadError`` naming the file where ``checkpoint`` cannot be resumed from: a missing or refused
    ``meta.pt`` or index, a shard missing or shorter than its index says, a stored object that is not plain data.
    Reads every non-tensor item (hyper-parameters: small) and no tensor; the shards' sizes are checked by
    :func:`load_items`."""
    checkpoint = Path(checkpoint)
    for name in (METADATA_FILE, INDEX_FILE):
        if not (checkpoint / name).is_file():
            raise CheckpointReadError(checkpoint, f"its {name} is missing")
    load_metadata(checkpoint)
    index = load_index(checkpoint)
    paths = item_paths(index)
    objects = {paths[fqn] for fqn, meta in index.state_dict_metadata.items() if isinstance(meta, BytesStorageMetadata)}
    load_items(checkpoint, objects.__contains__, index)


def load_weights_file(path: Path) -> dict[str, Any]:
    """A consolidated weights file (what ``python -m disttrain.checkpoint.export`` writes, or another trainer's
    ``torch.save`` of tensors): plain data only; ``CheckpointReadError`` naming the file otherwise. A run's
    starting weights (``model.init_weights``) are safetensors instead, read by ``disttrain.safetensors_reader``."""
    try:
        return plain_data(Path(path), "it")
    except UnsafeCheckpointError as err:
        raise CheckpointReadError(path, str(err)) from None


def one_process() -> bool:
    """No other rank shares this checkpoint: it is planned without collectives. Given a one-rank group,
    torch.distributed.checkpoint gathers its plan on gloo's own threads anyway, whose copies start OpenMP thread
    teams of their own; with more torch threads than one, every later training step of the digits CNN then ran
    much slower, from the first checkpoint on (benchmarks/README.md, Figures cited elsewhere).

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
