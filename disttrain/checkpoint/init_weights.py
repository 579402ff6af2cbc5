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
from disttrain.models.weights_fit import Saved, base_state, check_fit, tied_groups
from disttrain.safetensors_reader import ConfigRefusal, SafetensorsFile

INIT_WEIGHTS_KEY = "model.init_weights"
"""The config key this module reads and names in its refusals."""


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


def init_weights_file(path: str) -> SafetensorsFile:
    """The file ``model.init_weights`` names (resolved, as ``init_weights_of`` gives it), refused as a ConfigError
    on that key: by the job's check and by each rank's read alike."""
    return SafetensorsFile(Path(path), ConfigRefusal(INIT_WEIGHTS_KEY, path, "a safetensors file of the model's "
                                                                                "state_dict"))


def check_init_weights(net: nn.Module, path: str) -> InitWeightsFile:
    """``path``'s safetensors header holds every tensor of ``net`` (built on the meta device, possibly with
    adapters) at its shape, in a dtype it casts from, and nothing else, by the one rule of starting weights
    (``disttrain.models.weights_fit``): ConfigError naming ``model.init_weights``, the file, the tensor and what
    the model expects otherwise. Reads the header alone; returns what the run records of the file."""
    file = init_weights_file(path)
    saved = file.headers()
    state = base_state(net)
    check_fit(state, {name: Saved.of(name, saved[name]) for name in state if name in saved}, file.refuse,
              strangers=[Saved.of(name, header) for name, header in saved.items() if name not in state])
    return InitWeightsFile(path, len(saved), Path(path).stat().st_size)


def load_init_weights(net: nn.Module, path: str) -> None:
    """Replace ``net``'s parameters and persistent buffers (a model with real tensors, before its layout) with
    ``path``'s tensors, cast to the model's dtypes. A tied weight stored under several names must hold the same
    values under each. ValueError naming the file where it does not fit (the job checked it before)."""
    saved = init_weights_file(path).tensors()
    state = base_state(net)
    extra = sorted(set(saved) - set(state))
    if extra:
        raise ValueError(f"{path} holds {extra[0]}, which the model has not")
    with torch.no_grad():
        for group in tied_groups(state):
            tensor = state[group[0]]
            present = [saved[name] for name in group if name in saved]
            if not present:
                raise ValueError(f"{path} holds no tensor for {group[0]} of the model")
            if any(not torch.equal(other, present[0]) for other in present[1:]):
                raise ValueError(f"{path} holds different values under {', '.join(group)}, which the model ties "
                                 "(one tensor)")
            if tuple(present[0].shape) != tuple(tensor.shape):
                raise ValueError(f"{path} holds {group[0]} as {list(present[0].shape)}, where the model's is "
                                 f"{list(tensor.shape)}")
            tensor.copy_(present[0])


def start_from_init_weights(net: nn.Module, model: Any) -> nn.Module:
    """``net`` (just built from the model config ``model``) with ``model.init_weights`` read into it, where set."""
    path = getattr(model, "init_weights", None)
    if path is not None:
        load_init_weights(net, path)
    return net
