"""Whether saved tensors fit a model: the one rule every check of a run's starting weights applies.

Three keys name the weights a run starts from: ``model.init_weights`` (a safetensors file of the model's own
names, ``disttrain.checkpoint.init_weights``), ``model.pretrained=true`` (a Hugging Face folder, through
``transformers``' conversion where its layout differs, ``disttrain.models.hf.weights``) and llama's
``model.init_from`` (an HF Llama folder under HF's names, ``disttrain.models.llama_hf``). Each decides where each
of the model's tensors is saved (``Saved``, or a conversion's ``Source``) and hands that here, with the saved
tensors none of them reads where its loader refuses those; ``check_fit`` then refuses, in the caller's words (its
``Refuse``, which names the key and the file), a saved tensor the model has no place for, a tensor of the model
saved nowhere, one of another shape and one in a dtype that does not cast to the model's. It reads the headers
alone, so the job runs it against the model built on the meta device before any rank starts, and a rank runs it
again before reading a byte, refusing in the same line.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from disttrain.models.lora import base_name, has_adapters, holds_adapters, is_adapter
from disttrain.safetensors_reader import Box, Refuse, SafetensorsFile, TensorHeader

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2")
"""The safetensors dtypes a floating-point tensor of the model is read from (cast to the model's dtype)."""


@dataclass
class Saved:
    """One tensor of a safetensors file."""

    file: SafetensorsFile
    """The file holding it."""
    name: str
    """Its name in the file."""
    shape: tuple[int, ...]
    """Its shape, by the file's header."""
    dtype: str
    """Its safetensors dtype (``F32``, ``BF16``, ...)."""

    @classmethod
    def of(cls, name: str, header: TensorHeader) -> Saved:
        """The tensor ``name`` that ``header`` describes."""
        return cls(header.file, name, header.shape, header.dtype)

    def read(self, box: Box) -> torch.Tensor:
        """The ``box`` of the tensor, the only bytes read."""
        return self.file.part(self.name, box)

    def leaves(self) -> list[Saved]:
        """The saved tensors read."""
        return [self]


def base_state(net: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and persistent buffers of ``net`` (real or on the meta device) that starting weights replace,
    by the names the saved weights hold them under: a model with LoRA adapters without its adapters (they start
    from their own initialisation) and its wrapped base weights under their names without adapters
    (``q.base_layer.weight`` as ``q.weight``). A weight tied to another is the same tensor under both names."""
    state = net.state_dict(keep_vars=True)
    if not has_adapters(net):
        return state
    return {base_name(name): tensor for name, tensor in state.items() if not is_adapter(name)}


def tied_groups(state: Mapping[str, torch.Tensor]) -> list[list[str]]:
    """The names of ``state`` by tensor: a weight tied to another (a head sharing the token embedding) is one
    tensor under several names, of which the saved weights need hold one."""
    groups: dict[int, list[str]] = {}
    for name, tensor in state.items():
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def casts(saved: str, dtype: torch.dtype) -> bool:
    """Whether a saved tensor of safetensors dtype ``saved`` is read into one of ``dtype``: a floating-point
    tensor from any floating-point dtype; any other only from its own."""
    if dtype.is_floating_point:
        return saved in FLOAT_DTYPES
    own = {torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.int32: "I32",
           torch.int64: "I64"}
    return own.get(dtype) == saved


def check_fit(state: Mapping[str, torch.Tensor], sources: Mapping[str, Any], refuse: Refuse,
              strangers: Iterable[Saved] = (), saved_name: Callable[[str], str] = str) -> None:
    """``sources`` (the saved tensor, ``Saved``, or a conversion's ``Source``, that each of the model's tensors
    ``state`` is read from) fit the model, or ``refuse`` (the caller's, naming its key and file) says the first way
    they do not, in one line:

    - a saved tensor of ``strangers`` (those no tensor of the model is read from, where the caller's loader
      refuses them) that the model has not;
    - a tensor of the model saved nowhere (of a tied group, none of its names), named as the file would hold it
      (``saved_name`` of the model's name) with its shape;
    - a saved tensor of another shape than the model's;
    - a saved tensor in a dtype that does not cast to the model's (``casts``).
    """
    extra = list(strangers)
    if extra:
        more = f" (nor {len(extra) - 1} more)" if len(extra) > 1 else ""
        hint = ("; it holds a model with LoRA adapters, as an export with --keep-adapters writes it: export the run "
                "without that flag for its weights merged" if holds_adapters(t.name for t in extra) else "")
        raise refuse(f"{extra[0].file.path.name} holds {extra[0].name}{more}, which the model has not (the model's "
                     f"first: {saved_name(next(iter(state)))}){hint}")
    missing = [names[0] for names in tied_groups(state) if not any(name in sources for name in names)]
    if missing:
        raise refuse(lacking(missing, state, saved_name))
    for name, tensor in state.items():
        if name not in sources:
            continue
        source = sources[name]
        leaves = source.leaves()
        # the model's tensor named where the file holds it under another name (an HF Llama's, for the built-in)
        theirs = f" {name}" if leaves == [source] and source.name != name else ""
        if leaves == [source]:
            held = f"{source.file.path.name} holds {source.name}"
        else:
            more = f" (and {len(leaves) - 1} more)" if len(leaves) > 1 else ""
            held = f"the folder's {leaves[0].name}{more} give {name}"
        if tuple(source.shape) != tuple(tensor.shape):
            raise refuse(f"{held} as {list(source.shape)}, where the model's{theirs} is {list(tensor.shape)}")
        for leaf in leaves:
            if not casts(leaf.dtype, tensor.dtype):
                allowed = "one of " + ", ".join(FLOAT_DTYPES) if tensor.is_floating_point() else "the same"
                raise refuse(f"{leaf.file.path.name} holds {leaf.name} as {leaf.dtype}, which does not cast to "
                             f"the model's{theirs + ',' if theirs else ''} {str(tensor.dtype).removeprefix('torch.')}"
                             f" ({allowed})")


def lacking(missing: list[str], state: Mapping[str, torch.Tensor], saved_name: Callable[[str], str] = str) -> str:
    """What is wrong with saved weights that lack the model's tensors ``missing`` (of ``state``): the first, as the
    file would hold it (``saved_name``), its shape, and how many more."""
    more = f" (nor {len(missing) - 1} more)" if len(missing) > 1 else ""
    first = missing[0]
    theirs = f" (the model's {first})" if saved_name(first) != first else ""
    return f"it lacks {saved_name(first)}{more}{theirs}, of shape {list(state[first].shape)}"
