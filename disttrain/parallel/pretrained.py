"""Starting weights from a Hugging Face folder, read into a model that is already laid out over its ranks.

Each rank reads, from the folder's safetensors files, only the part of each tensor it holds: the rows of its
FSDP2 shard, its tensor-parallel slice, its experts, its pipeline stage's tensors. safetensors' sliced reads fetch
just those bytes, so no rank holds the whole model's weights, or a whole tensor, at once. (torch.distributed.
checkpoint's Hugging Face reader kept far more resident than the shards on each ZeRO-3 rank; benchmarks/README.md,
Figures cited elsewhere.) A Hugging Face model's tensors saved in another layout (a mixture's experts one tensor
per expert, as ``save_pretrained`` writes them) are read through ``transformers``' conversion mapping
(``disttrain.models.hf.conversion``): a rank holding some experts reads only those experts' tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from disttrain.models.hf.conversion import Conversion, Source, saved_sources
from disttrain.models.weights_fit import lacking
from disttrain.safetensors_reader import SafetensorsFolder


def load_pretrained(model: nn.Module, folder: SafetensorsFolder, conversion: Conversion | None = None,
                    adapters: dict[str, Any] | None = None) -> None:
    """Replace ``model``'s parameters and persistent buffers with the folder's tensors of the same names, or those
    ``conversion`` (the model's ``pretrained_conversion``, taken before it was laid out) converts into them.
    ``adapters``: the initial values of LoRA adapters, which the folder does not hold
    (``disttrain.models.lora.initial_adapter_sources``, taken before the model was laid out).

    A name the folder lacks is the folder's own refusal (one line on the key that named it), except a weight tied
    to one it holds (a head sharing the token embedding is saved once) and an adapter of ``adapters``; so is a
    file no longer whole.
    """
    state = get_model_state_dict(model)  # the parameters' own tensors (sharded, sliced), written in place below
    saved = folder.headers()  # a folder changed since the job checked it is refused as the job would have
    sources: dict[str, Any] = {**saved_sources(state, saved, conversion), **(adapters or {})}
    storages = {_storage(tensor): name for name, tensor in state.items() if name in sources}
    tied = {name for name, tensor in state.items() if name not in sources and _storage(tensor) in storages}
    missing = sorted(set(state) - set(sources) - tied)
    if missing:
        raise folder.refuse(lacking(missing, state))
    with torch.no_grad():
        for name, tensor in state.items():
            if name not in tied:
                _read_part(tensor, sources[name], name)


def _read_part(tensor: torch.Tensor, source: Source, name: str) -> None:
    """Copy into ``tensor`` (a DTensor's local part, or a whole tensor) its region of the saved tensor."""
    if isinstance(tensor, DTensor):
        shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        local = tensor.to_local()
    else:
        shape, offset, local = tuple(tensor.shape), (0,) * tensor.dim(), tensor
    if tuple(source.shape) != tuple(tensor.shape):
        raise ValueError(f"{name}: the folder's tensor has shape {tuple(source.shape)}, the model's "
                         f"{tuple(tensor.shape)}")
    if local.numel():
        part = source.read(tuple((start, start + size) for start, size in zip(offset, shape, strict=True)))
        local.copy_(part.reshape(local.shape))


def _storage(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.untyped_storage().data_ptr()
