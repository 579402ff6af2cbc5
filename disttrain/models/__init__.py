"""Model registry: configs name a model (``model.name``) and ``build_model`` builds it for the data.

Each model module registers a builder ``(cfg, spec) -> nn.Module`` together with its config schema, a
dataclass whose ``validate(spec)`` rejects impossible values before any rank starts.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from disttrain.data.spec import DataSpec
from disttrain.models.target import TargetModelConfig, build_target_model
from disttrain.registry import Registry

MODELS: Registry[nn.Module] = Registry("model")

# The model modules register themselves in MODELS, so they are imported after it exists.
from disttrain.models import cnn, gpt, llama  # noqa: E402
from disttrain.models.cnn import CNN, CNNConfig  # noqa: E402
from disttrain.models.gpt import FLAVOURS, GPT, GPTConfig, GPTDims, resolve_gpt_dims  # noqa: E402


def build_model(cfg: Any, spec: DataSpec) -> nn.Module:
    """Validate ``cfg`` against the data's ``spec`` and build the model it names (a registry name, or a
    ``_target_`` for a user's model), on the current device."""
    if isinstance(cfg, TargetModelConfig):
        return build_target_model(cfg, spec)
    return MODELS.build(cfg, spec)


__all__ = [
    "CNN",
    "FLAVOURS",
    "GPT",
    "MODELS",
    "CNNConfig",
    "DataSpec",
    "GPTConfig",
    "GPTDims",
    "TargetModelConfig",
    "build_model",
    "cnn",
    "gpt",
    "llama",
    "resolve_gpt_dims",
]
