"""Composed config nodes merged into their typed schemas, with OmegaConf's errors rephrased as one line."""

from __future__ import annotations

import difflib
from functools import cache
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from disttrain.errors import ConfigError
from disttrain.models.registry import with_open_fields
from disttrain.models.target import TargetModelConfig
from disttrain.parallel.config import ParallelConfig


def typed(group: str, node: Any, schema: type) -> Any:
    """Merge a config node into its dataclass schema; rephrase OmegaConf's errors as one line."""
    _reject_unknown_keys(group, node, schema)
    try:
        merged = OmegaConf.merge(schema_node(schema), node)
        obj = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        key = ".".join(part for part in (group, getattr(err, "full_key", None)) if part) or "config"
        if isinstance(err, MissingMandatoryValue) or "Missing mandatory value" in str(err):
            missing = key if key.count(".") or not group else f"{group}.{_missing_field(err)}"
            raise ConfigError(missing, "???", f"a value is required (set {missing}=...)") from None
        value = getattr(err, "value", None) or _lookup(node, err.full_key)
        raise ConfigError(key, value, f"expected {field_type(schema, err.full_key)}") from None
    return obj


@cache
def schema_node(schema: type) -> DictConfig:
    """``schema`` as a structured config node, built once per class (building it is slow, and every validation
    of every rank needs it); ``OmegaConf.merge`` copies its first argument, so the node itself never changes."""
    return OmegaConf.structured(schema)


def _missing_field(err: OmegaConfBaseException) -> str:
    """The field a structured config's "has missing mandatory value: <field>" message names."""
    return str(err).split("missing mandatory value:")[-1].split()[0] if "missing mandatory value:" in str(err) \
        else "?"


def _reject_unknown_keys(prefix: str, node: Any, schema: type) -> None:
    """Keys forced in with ``+key=...`` or left in a typed node survive a merge silently; name them here."""
    fields = getattr(schema, "__dataclass_fields__", None)
    if fields is None or not isinstance(node, (DictConfig, dict)):
        return
    for key in node:
        path = f"{prefix}.{key}" if prefix else str(key)
        if key not in fields:
            raise unknown_key(path, node[key], list(fields))
        factory = fields[key].default_factory
        if hasattr(factory, "__dataclass_fields__"):
            _reject_unknown_keys(path, node[key], factory)


def unknown_key(path: str, value: Any, known: list[str]) -> ConfigError:
    """The error for a key its schema lacks: the keys it has, and the nearest one when the key looks like a typo."""
    parent, _, name = path.rpartition(".")
    near = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {'.'.join(filter(None, (parent, near[0])))}?)" if near else ""
    return ConfigError(path, value, f"not a known key{hint}; {parent or 'top-level'} keys are {known}")


def field_type(schema: type, dotted: str | None) -> str:
    """Readable type of a (possibly nested) dataclass field."""
    fields = getattr(schema, "__dataclass_fields__", {})
    head, _, rest = (dotted or "").partition(".")
    if head not in fields:
        return "a value of the schema's type"
    ftype = fields[head].type
    if rest and hasattr(fields[head].default_factory, "__dataclass_fields__"):
        return field_type(fields[head].default_factory, rest)
    return f"type {ftype}"


def _lookup(node: Any, dotted: str | None) -> Any:
    """Value at a dotted path of a config node, or None."""
    try:
        return OmegaConf.select(node, dotted) if dotted else None
    except OmegaConfBaseException:
        return None


def model_typed(node: Any, registry: Any) -> Any:
    """A registered model by ``name``, or a user's model by ``_target_``."""
    if isinstance(node, DictConfig) and "_target_" in node:
        if "name" in node:
            raise ConfigError("model.name", node.name, "absent when model._target_ is set (one or the other)")
        return TargetModelConfig.from_node(OmegaConf.to_container(node, resolve=True))
    if isinstance(node, DictConfig) and "name" in node and node.name in registry.names():
        node = with_open_fields(node, registry.get(node.name).schema)
    return registry_typed("model", node, registry)


def data_typed(node: Any, registry: Any) -> Any:
    """A registered data set by ``name``, or a user's data by ``_target_``."""
    from disttrain.data import UserDataConfig

    if isinstance(node, DictConfig) and "_target_" in node:
        if "name" in node:
            raise ConfigError("data.name", node.name, "absent when data._target_ is set (one or the other)")
        return UserDataConfig(OmegaConf.to_container(node, resolve=True))
    return registry_typed("data", node, registry)


def registry_typed(group: str, node: Any, registry: Any) -> Any:
    """Type a polymorphic group by the schema its ``name`` selects in ``registry``."""
    if not isinstance(node, DictConfig) or "name" not in node:
        raise ConfigError(f"{group}.name", None, f"a {group} config needs a name, one of {registry.names()}")
    return typed(group, node, registry.get(node.name).schema)


def parallel_options(cfg: DictConfig) -> ParallelConfig:
    """The typed ``parallel`` node alone (its backend and timeout join a launcher's process group before the
    run directory is agreed and the whole config validated)."""
    return typed("parallel", cfg.parallel, ParallelConfig)


def typed_groups(cfg: DictConfig) -> tuple[Any, Any, Any, Any, Any]:
    """The config's groups as typed objects: the top level, model, data, optimiser and schedule."""
    from disttrain.config.schema import TrainConfig
    from disttrain.data import DATA
    from disttrain.models import MODELS
    from disttrain.optim import OPTIMIZERS, SchedulerConfig

    return (typed("", cfg, TrainConfig), model_typed(cfg.model, MODELS), data_typed(cfg.data, DATA),
            registry_typed("optim", cfg.optim, OPTIMIZERS), typed("scheduler", cfg.scheduler, SchedulerConfig))
