"""A model's parallel plan: what its protocol methods declare, or what the config says in their place.

The config keys (``parallel.tp_plan``, ``parallel.pipeline_units``, ``parallel.shard_units``) serve models
their users cannot edit; when given they win over the model's methods. See ``disttrain.models.protocol``.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from torch import nn

from disttrain.models.protocol import expand_units


def tp_plan_of(model: nn.Module, configured: dict[str, str] | None = None) -> dict[str, str] | None:
    """The tensor-parallel plan: ``configured``, else ``model.tp_plan()``, else None."""
    if configured:
        return dict(configured)
    method = getattr(model, "tp_plan", None)
    return dict(method()) if callable(method) else None


def pipeline_units_of(model: nn.Module, configured: list[str] | None = None) -> list[str] | None:
    """The pipeline units with every ``ModuleList`` expanded: ``configured``, else ``model.pipeline_units()``."""
    names = configured or (model.pipeline_units() if callable(getattr(model, "pipeline_units", None)) else None)
    return expand_units(model, list(names)) if names else None


def shard_units_of(model: nn.Module, configured: list[str] | None = None,
                   min_params_per_unit: int = 100_000) -> list[nn.Module]:
    """Modules that each become an FSDP unit (and are checkpointed as a whole).

    ``configured``, else ``model.shard_units()``, else the entries of the model's ``ModuleList`` children,
    else every direct child with at least ``min_params_per_unit`` parameters that shares none with the rest
    of the model (tied weights must stay in one unit; they go to the root).
    """
    names = configured or (model.shard_units() if callable(getattr(model, "shard_units", None)) else None)
    if names:
        return [model.get_submodule(name) for name in expand_units(model, list(names))]
    children = list(model.children())
    repeated = [entry for child in children if isinstance(child, nn.ModuleList) for entry in child]
    if repeated:
        return repeated
    units = []
    for child in children:
        own = {id(p) for p in child.parameters()}
        others = {id(p) for c in children if c is not child for p in c.parameters()}
        others |= {id(p) for p in model.parameters(recurse=False)}
        if sum(p.numel() for p in child.parameters()) >= min_params_per_unit and not own & others:
            units.append(child)
    return units


def matching_modules(model: nn.Module, pattern: str) -> list[str]:
    """Names of the modules of ``model`` that ``pattern`` matches, part by dotted part (``blocks.*.attn.q``)."""
    parts = pattern.split(".")
    return [name for name, _ in model.named_modules() if name
            and len(name.split(".")) == len(parts)
            and all(fnmatchcase(n, p) for n, p in zip(name.split("."), parts, strict=True))]
