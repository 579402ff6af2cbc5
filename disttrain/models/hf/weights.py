"""Whether a Hugging Face folder's safetensors weights fit a model, from their headers alone.

``model.pretrained=true`` reads these files inside every rank, after the model is laid out; a file cut short, a
header that is not one, or a tensor of another shape would fail there, in every rank. ``check_weights`` reads
only the files' headers (names, shapes, dtypes, and that the data they describe fills the file, through
``disttrain.safetensors_reader``) against the model built on the meta device, so the job refuses such a folder
in one line before any rank starts.
"""

from __future__ import annotations

from typing import Any

import torch

from disttrain.models.hf.conversion import conversion_of, saved_sources
from disttrain.models.lora import has_adapters, is_adapter
from disttrain.safetensors_reader import SafetensorsFolder

FLOAT_DTYPES = ("F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2")
"""The safetensors dtypes a floating-point tensor of the model is read from (the reader casts them)."""


def check_weights(net: Any, folder: SafetensorsFolder) -> None:
    """``folder``'s safetensors headers hold every tensor of ``net`` (a model built on the meta device, whose
    parameters and persistent buffers the folder replaces) at the model's shape and in a dtype it casts from: under
    its own name, or, for a Hugging Face model, in a layout ``transformers`` converts from (per-expert tensors of a
    mixture, ``disttrain.models.hf.conversion``). A weight tied to one the folder holds may be absent (a head
    sharing the token embedding is saved once). The folder's refusal (a ConfigError on the key that named it)
    naming the file, the tensor, what the file holds and what the model needs."""
    saved = folder.headers()
    groups: dict[int, list[str]] = {}  # a tied weight is one tensor under several names
    state = net.state_dict(keep_vars=True)
    if has_adapters(net):  # adapters start from their own initialisation, not from the folder
        state = {name: tensor for name, tensor in state.items() if not is_adapter(name)}
    for name, tensor in state.items():
        groups.setdefault(id(tensor), []).append(name)
    try:
        sources = saved_sources(state, saved, conversion_of(net))
    except ValueError as err:
        raise folder.refuse(str(err)) from None
    missing = [names[0] for names in groups.values() if not any(name in sources for name in names)]
    if missing:
        more = f" (nor {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise folder.refuse(f"no file of the folder holds {missing[0]}{more}")
    for name, tensor in state.items():
        if name not in sources:
            continue
        source = sources[name]
        leaves = source.leaves()
        if leaves == [source]:
            held = f"{source.file.path.name} holds {source.name}" + (
                f" (the model's {name})" if source.name != name else "")
        else:
            held = (f"the folder's {leaves[0].name}{f' (and {len(leaves) - 1} more)' if len(leaves) > 1 else ''} "
                    f"give {name}")
        if tuple(source.shape) != tuple(tensor.shape):
            raise folder.refuse(f"{held} as {list(source.shape)}, where the model's is {list(tensor.shape)}")
        for leaf in leaves:
            if not _casts(leaf.dtype, tensor.dtype):
                allowed = "one of " + ", ".join(FLOAT_DTYPES) if tensor.is_floating_point() else "the same"
                raise folder.refuse(f"{leaf.file.path.name} holds {leaf.name} as {leaf.dtype}, which does not cast "
                                    f"to the model's {str(tensor.dtype).removeprefix('torch.')} ({allowed})")


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
