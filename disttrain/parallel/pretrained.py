"""Starting weights from a Hugging Face folder, read into a model that is already laid out over its ranks.

Each rank reads, from the folder's safetensors files, only the part of each tensor it holds: the rows of its
FSDP2 shard, its tensor-parallel slice, its pipeline stage's tensors. safetensors' sliced reads fetch just those
bytes, so no rank holds the whole model's weights, or a whole tensor, at once. (torch.distributed.checkpoint's
Hugging Face reader kept far more resident than the shards on each ZeRO-3 rank; benchmarks/README.md, Figures
cited elsewhere.)
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from disttrain.models.hf_weights import weight_files


def saved_files(folder: Path) -> dict[str, Path]:
    """Which safetensors file of ``folder`` holds each tensor name (read from the headers of the files that the
    job's validation checked: ``model.safetensors``, else the shards its index names)."""
    from safetensors import safe_open

    names: dict[str, Path] = {}
    for path in weight_files(folder):
        with safe_open(str(path), framework="pt") as handle:
            names.update(dict.fromkeys(handle.keys(), path))
    return names


def load_pretrained(model: nn.Module, folder: str) -> None:
    """Replace ``model``'s parameters and persistent buffers with the folder's tensors of the same names.

    A name the folder lacks is an error, except a weight tied to one it holds (a head sharing the token
    embedding is saved once, under the embedding's name).
    """
    from safetensors import safe_open

    state = get_model_state_dict(model)  # the parameters' own tensors (sharded, sliced), written in place below
    files = saved_files(Path(folder))
    storages = {_storage(tensor): name for name, tensor in state.items() if name in files}
    tied = {name for name, tensor in state.items() if name not in files and _storage(tensor) in storages}
    missing = sorted(set(state) - set(files) - tied)
    if missing:
        raise ValueError(f"{folder} holds no tensor for {missing[:5]}{' ...' if len(missing) > 5 else ''} of the model")
    by_file: dict[Path, list[str]] = {}
    for name in state:
        if name not in tied:
            by_file.setdefault(files[name], []).append(name)
    with torch.no_grad():
        for path, names in by_file.items():
            for name in names:
                # opened per tensor: the file is memory-mapped, and pages read stay resident until it is closed
                with safe_open(str(path), framework="pt") as handle:
                    _read_part(state[name], handle.get_slice(name), name)


def _read_part(tensor: torch.Tensor, saved: object, name: str) -> None:
    """Copy into ``tensor`` (a DTensor's local part, or a whole tensor) its region of the saved tensor."""
    if isinstance(tensor, DTensor):
        shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        local = tensor.to_local()
    else:
        shape, offset, local = tuple(tensor.shape), (0,) * tensor.dim(), tensor
    if tuple(saved.get_shape()) != tuple(tensor.shape):
        raise ValueError(f"{name}: the folder's tensor has shape {tuple(saved.get_shape())}, the model's "
                         f"{tuple(tensor.shape)}")
    if local.numel():
        part = saved[tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))]
        local.copy_(part.reshape(local.shape))


def _storage(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.untyped_storage().data_ptr()
