"""Users' own models: any importable callable named by ``_target_`` that returns an ``nn.Module``.

``python train.py model=custom model._target_=mypkg.nets.Net +model.width=256`` builds
``mypkg.nets.Net(width=256)`` with Hydra's ``instantiate``. Arguments the callable takes by the names of the
data's spec (``num_classes``, ``in_channels``, ``image_size``, ``vocab_size``, ``block_size``) and that the
config leaves out are filled from the data, so one model config fits several data sets.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field, fields
from typing import Any

from torch import nn

from disttrain.data.spec import DataSpec
from disttrain.errors import ConfigError
from disttrain.targets import call, locate

SPEC_ARGUMENTS = ("num_classes", "in_channels", "image_size", "vocab_size", "block_size")
"""Argument names filled from the data's spec when the callable takes them and the config does not set them."""


@dataclass
class TargetModelConfig:
    """A model given by ``_target_`` (no registry name): the callable and its keyword arguments."""

    target: str
    """Dotted path of the callable (a class or a function) that returns the model."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Its keyword arguments: every other key of the model node."""

    @property
    def name(self) -> str:
        """How messages name the model: its dotted path."""
        return self.target

    @classmethod
    def from_node(cls, node: dict[str, Any]) -> TargetModelConfig:
        """Split a model node into ``_target_`` and arguments."""
        target = node.get("_target_")
        if not isinstance(target, str) or not target:
            raise ConfigError("model._target_", target, "the dotted path of a callable that returns an nn.Module")
        return cls(target, {k: v for k, v in node.items() if k != "_target_"})


def build_target_model(cfg: TargetModelConfig, spec: DataSpec) -> nn.Module:
    """Call ``cfg.target`` with its arguments (and the spec's, where it takes them); ConfigError naming
    ``model._target_`` if it cannot be imported, fails, or returns no ``nn.Module``; ConfigError naming
    ``data.document_mask`` for packed windows, whose document boundaries such a model is not told."""
    if spec.document_end is not None:
        raise ConfigError("data.document_mask", True, f"false for model._target_={cfg.target}: a model of your own "
                          "is not told where packed documents end (gpt, llama, moe and model=hf are)")
    target = locate(cfg.target, "model._target_")
    kwargs = {**_spec_arguments(target, spec, cfg.kwargs), **cfg.kwargs}
    model = call(cfg.target, kwargs, "model._target_", "a callable that builds the model")
    if not isinstance(model, nn.Module):
        raise ConfigError("model._target_", cfg.target, f"a callable that returns an nn.Module, not a "
                          f"{type(model).__name__}")
    return model


def _spec_arguments(target: Any, spec: DataSpec, given: dict[str, Any]) -> dict[str, Any]:
    try:
        parameters = inspect.signature(target).parameters
    except (TypeError, ValueError):  # builtins and some C extensions have no signature
        return {}
    values = {f.name: getattr(spec, f.name) for f in fields(spec)}
    return {name: values[name] for name in SPEC_ARGUMENTS
            if name in parameters and name not in given and values.get(name) is not None}
