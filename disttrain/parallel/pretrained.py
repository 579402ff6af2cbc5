"""Starting weights from a Hugging Face folder, read into a model that is already laid out over its ranks.

torch.distributed.checkpoint's Hugging Face reader loads safetensors by tensor name into whatever tensors the
state dict holds: a rank's FSDP2 shards and tensor-parallel slices take only their parts, so no rank holds the
whole model's weights at once (a pipeline stage asks only for its own names).
"""

from __future__ import annotations

from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict


def saved_names(folder: Path) -> set[str]:
    """The tensor names in a folder's safetensors files (read from their headers, no tensor is loaded)."""
    from safetensors import safe_open

    names: set[str] = set()
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            names |= set(handle.keys())
    return names


def load_pretrained(model: nn.Module, folder: str) -> None:
    """Replace ``model``'s parameters and persistent buffers with the folder's tensors of the same names.

    A name the folder lacks is an error, except a weight tied to one it holds (a head sharing the token
    embedding is saved once, under the embedding's name).
    """
    state = get_model_state_dict(model)
    saved = saved_names(Path(folder))
    tied = {name for name in state if name not in saved and any(
        state[name] is state[other] or _same_storage(state[name], state[other]) for other in state if other in saved)}
    missing = sorted(set(state) - saved - tied)
    if missing:
        raise ValueError(f"{folder} holds no tensor for {missing[:5]}{' ...' if len(missing) > 5 else ''} of the model")
    wanted = {name: tensor for name, tensor in state.items() if name not in tied}
    dcp.load(wanted, storage_reader=HuggingFaceStorageReader(folder))
    set_model_state_dict(model, {**state, **wanted})


def _same_storage(a: object, b: object) -> bool:
    local = [getattr(t, "_local_tensor", t) for t in (a, b)]
    try:
        return local[0].untyped_storage().data_ptr() == local[1].untyped_storage().data_ptr()
    except (AttributeError, RuntimeError):
        return False
