"""The parallel plan of a Hugging Face model, read from what its config declares.

``base_model_tp_plan`` maps module patterns of the base model to ``transformers``' tensor-parallel styles; the
ones disttrain honours are translated (``colwise``, ``rowwise``, and ``replicated_with_grad_allreduce`` as
``per_head``), any other is refused by name. The pipeline stages cut from ``base_model_pp_plan`` are
``disttrain.models.hf_pipeline``'s.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from disttrain.errors import ConfigError

TP_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "replicated_with_grad_allreduce": "per_head"}
"""``transformers``' tensor-parallel styles that disttrain honours, and their names here."""


def _base(net: nn.Module) -> tuple[str, Any]:
    """The base model's attribute name (``model``, ``transformer``) and the base model."""
    prefix = net._model.base_model_prefix
    return prefix, getattr(net, prefix)


def tp_plan(net: nn.Module) -> dict[str, str]:
    """The config's tensor-parallel plan under the network's names and disttrain's styles."""
    prefix, _ = _base(net)
    plan = getattr(net.hf_config, "base_model_tp_plan", None) or {}
    ours = {}
    for pattern, style in plan.items():
        if style not in TP_STYLES:
            raise ConfigError("parallel.tp", f"{pattern}: {style}", f"1 for model type {net.hf_config.model_type}: "
                              f"its tp plan uses style {style!r}, and disttrain runs {sorted(TP_STYLES)}")
        ours[f"{prefix}.{pattern}"] = TP_STYLES[style]
    return ours


def layer_lists(net: nn.Module) -> list[str]:
    """The ``ModuleList`` names that hold the model's decoder layers (its never-split classes)."""
    never_split = set(getattr(net._model, "_no_split_modules", None) or ())
    return [name for name, module in net.named_modules()
            if isinstance(module, nn.ModuleList) and len(module) and type(module[0]).__name__ in never_split]
