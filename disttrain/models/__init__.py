"""Models: configs name a model (``model.name``) and ``build_model`` builds it for the data.

Each model module registers a builder ``(cfg, spec) -> nn.Module`` together with its config schema (see
``registry``), a dataclass whose ``validate(spec)`` rejects impossible values before any rank starts;
importing this package imports every built-in model module and so registers it.
"""

from __future__ import annotations

from disttrain.data.spec import DataSpec
from disttrain.models import cnn, gpt, hf, llama, moe
from disttrain.models.cnn import CNN, CNNConfig
from disttrain.models.gpt import FLAVOURS, GPT, GPTConfig, GPTDims, resolve_gpt_dims
from disttrain.models.registry import MODELS, build_model
from disttrain.models.target import TargetModelConfig

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
    "hf",
    "llama",
    "moe",
    "resolve_gpt_dims",
]
