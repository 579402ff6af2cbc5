"""``model.init_weights``: a run that starts from the tensors of a safetensors file instead of its seeded init.

The file holds the model's ``state_dict()`` by its own names (a weight tied to another, such as GPT's head and
token embedding, once under either name). The job checks the file's header against the model built on the meta
device, strictly: a tensor missing, one the model has not, or one of another shape is one ``ConfigError`` naming
the key, the file and what the model expected, before any rank starts. Each rank then reads the file into the
model it has just built on its device, before the model is laid out, so every layout (single, DDP, ZeRO, tensor
or pipeline parallel) starts from the same weights. The file is read through the one reader of safetensors files
(``disttrain.safetensors_reader``): a JSON header and raw bytes, never code. The job's check returns the file as it
found it (``InitWeightsFile``: path, tensor count, size), which the run names in its start-up line and in
``results.json``. ``python -m disttrain.checkpoint.export RUN --format safetensors FILE`` writes such a file from a
run's checkpoint.

Unlike ``resume``, which continues a run (its weights, optimiser state, step and schedule), a run from
``init_weights`` starts at step 0 with a fresh optimiser and schedule; a ``resume`` set beside it wins. It is the
field of every built-in model (gpt, llama, moe, cnn, hf), but not beside llama's ``model.init_from`` or hf's
``model.pretrained=true``, which name the starting weights already (a Hugging Face folder; the second read straight
into the laid-out shards); a user's own model (``model._target_``) loads what it likes in its constructor.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from disttrain.errors import ConfigError
from disttrain.safetensors_reader import ConfigRefusal, SafetensorsFile

INIT_WEIGHTS_KEY = "model.init_weights"
"""The config key this module reads and names in its refusals."""
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")
"""The safetensors dtypes a floating-point tensor of the model is read from (cast to the model's dtype)."""


@dataclass(frozen=True)
class InitWeightsFile:
    """The file a run starts from, as the job found it before any rank started: what the run's start-up line and
    its ``results.json`` name, so that a result can be traced to its initial weights."""

    path: str
    """The file's absolute path."""
    tensors: int
    """How many tensors the file holds."""
    size_bytes: int
    """The file's size when the job checked it."""

    def notice(self, resume: str | None) -> str:
        """The start-up line that says the run starts from this file (``resume``: the run's, which wins)."""
        line = (f"{INIT_WEIGHTS_KEY}: the model starts from {self.path} ({self.tensors} tensors, "
                f"{self.size_bytes:,} bytes)")
        if resume is None:
            return line + ", at step 0 with a fresh optimiser"
        return line + f"; resume={resume} is set beside it: a checkpoint it finds replaces these weights"


def init_weights_of(model: Any) -> str | None:
    """The file ``model`` (a model config) starts from; ConfigError where another key already names the starting
    weights (llama's ``init_from``, hf's ``pretrained``)."""
    path = getattr(model, "init_weights", None)
    if path is None:
        return None
    if getattr(model, "init_from", None) is not None:
        raise ConfigError(INIT_WEIGHTS_KEY, path, f"null with model.init_from={model.init_from!r}: both name the "
                          "weights the model starts from (keep one)")
    if getattr(model, "pretrained", False):
        raise ConfigError(INIT_WEIGHTS_KEY, path, "null with model.pretrained=true: the folder's weights are the "
                          "start already (keep one; init_weights reads one file of the model's own names)")
    return str(Path(path).expanduser().resolve())


def _expected(net: nn.Module) -> dict[str, tuple[list[str], torch.Tensor]]:
    """The model's state by tensor: per tensor, the names it goes by in the file (tied names share one tensor) and
    the tensor. A model with LoRA adapters goes by the names of the model without them (the file holds the base
    model; adapters start from their own initialisation)."""
    from disttrain.models.lora import base_name, has_adapters, is_adapter

    adapters = has_adapters(net)
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, tensor in net.state_dict(keep_vars=True).items():
        if adapters and is_adapter(name):
            continue
        groups.setdefault(id(tensor), ([], tensor))[0].append(base_name(name) if adapters else name)
    return {names[0]: (names, tensor) for names, tensor in groups.values()}


def init_weights_file(path: str) -> SafetensorsFile:
    """The file ``model.init_weights`` names (resolved, as ``init_weights_of`` gives it), refused as a ConfigError
    on that key: by the job's check and by each rank's read alike."""
    return SafetensorsFile(Path(path), ConfigRefusal(INIT_WEIGHTS_KEY, path, "a safetensors file of the model's "
                                                                                "state_dict"))


def check_init_weights(net: nn.Module, path: str) -> InitWeightsFile:
    """``path``'s safetensors header holds every tensor of ``net`` (built on the meta device, possibly with
    adapters) at its shape, in a dtype it casts from, and nothing else: ConfigError naming ``model.init_weights``,
    the file, the tensor and what the model expects otherwise. Reads the header alone; returns what the run
    records of the file."""
    saved = init_weights_file(path).headers()
    groups = _expected(net)
    names = {name: tensor for group, tensor in groups.values() for name in group}
    unexpected = [name for name in saved if name not in names]
    if unexpected:
        more = f" (nor {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
        raise ConfigError(INIT_WEIGHTS_KEY, path, f"a safetensors file of this model's state_dict; it holds "
                          f"{unexpected[0]}{more}, which the model has not (the model's first: {next(iter(names))})")
    missing = [first for first, (group, _) in groups.items() if not any(name in saved for name in group)]
    if missing:
        more = f" (nor {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(INIT_WEIGHTS_KEY, path, f"a safetensors file of this model's state_dict; it lacks "
                          f"{missing[0]}{more}, of shape {list(names[missing[0]].shape)}")
    for name, (_, shape, dtype) in saved.items():
        tensor = names[name]
        if tuple(shape) != tuple(tensor.shape):
            raise ConfigError(INIT_WEIGHTS_KEY, path, f"a safetensors file of this model's state_dict; it holds "
                              f"{name} as {list(shape)}, where the model's is {list(tensor.shape)}")
        if tensor.is_floating_point() and dtype not in FLOAT_DTYPES:
            raise ConfigError(INIT_WEIGHTS_KEY, path, f"a safetensors file of this model's state_dict; it holds "
                              f"{name} as {dtype}, where the model's {tensor.dtype} is read from one of "
                              f"{', '.join(FLOAT_DTYPES)}")
    return InitWeightsFile(path, len(saved), Path(path).stat().st_size)


def load_init_weights(net: nn.Module, path: str) -> None:
    """Replace ``net``'s parameters and persistent buffers (a model with real tensors, before its layout) with
    ``path``'s tensors, cast to the model's dtypes. A tied weight stored under several names must hold the same
    values under each. ValueError naming the file where it does not fit (the job checked it before)."""
    saved = init_weights_file(path).tensors()
    groups = _expected(net)
    extra = sorted(set(saved) - {name for group, _ in groups.values() for name in group})
    if extra:
        raise ValueError(f"{path} holds {extra[0]}, which the model has not")
    with torch.no_grad():
        for first, (group, tensor) in groups.items():
            present = [saved[name] for name in group if name in saved]
            if not present:
                raise ValueError(f"{path} holds no tensor for {first} of the model")
            if any(not torch.equal(other, present[0]) for other in present[1:]):
                raise ValueError(f"{path} holds different values under {', '.join(group)}, which the model ties "
                                 "(one tensor)")
            if tuple(present[0].shape) != tuple(tensor.shape):
                raise ValueError(f"{path} holds {first} as {list(present[0].shape)}, where the model's is "
                                 f"{list(tensor.shape)}")
            tensor.copy_(present[0])


def start_from_init_weights(net: nn.Module, model: Any) -> nn.Module:
    """``net`` (just built from the model config ``model``) with ``model.init_weights`` read into it, where set."""
    path = getattr(model, "init_weights", None)
    if path is not None:
        load_init_weights(net, path)
    return net
