"""Model registry: configs name a model (``model.name``) and ``build_model`` builds it for the data.

Each model module registers a builder ``(cfg, spec) -> nn.Module`` together with its config schema, a
dataclass whose ``validate(spec)`` rejects impossible values before any rank starts. The registry lives
apart from the package so that the model modules can register in it while the package imports them.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from disttrain.data.spec import DataSpec
from disttrain.models.target import TargetModelConfig, build_target_model
from disttrain.registry import Registry

MODELS: Registry[nn.Module] = Registry("model")
"""Built-in models by name: each model module adds its own when it is imported."""


def build_model(cfg: Any, spec: DataSpec) -> nn.Module:
    """Validate ``cfg`` against the data's ``spec`` and build the model it names (a registry name, or a
    ``_target_`` for a user's model), on the current device, with the LoRA adapters its ``lora`` asks for
    (``disttrain.models.lora``)."""
    if isinstance(cfg, TargetModelConfig):
        return build_target_model(cfg, spec)
    lora = getattr(cfg, "lora", None)
    if lora is not None:  # before the build, and with the adapters off too (model.lora.double_quant without them)
        lora.validate()
    net = MODELS.build(cfg, spec)
    if lora is not None and lora.enabled:  # here, so every reader of a run's model builds the same network
        from disttrain.models.lora import add_adapters

        net = add_adapters(net, lora)
    return net


def with_open_fields(node: Any, schema: type) -> Any:
    """A model node as its schema takes it: a schema open to its architecture's own fields (``OPEN_FIELDS``,
    e.g. ``+model.hidden_size=256`` for ``model=hf``) gets every key it lacks moved under that field."""
    from omegaconf import OmegaConf

    into = getattr(schema, "OPEN_FIELDS", None)
    if into is None:
        return node
    own = set(schema.__dataclass_fields__)
    plain = OmegaConf.to_container(node, resolve=True)
    extra = {key: plain.pop(key) for key in list(plain) if key not in own}
    plain[into] = {**(plain.get(into) or {}), **extra}
    return OmegaConf.create(plain)
