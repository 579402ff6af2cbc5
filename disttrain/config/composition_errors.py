"""Hydra's composition errors (an unknown key, a value of the wrong type, a missing group option, an override it
cannot parse) rephrased as the one line the framework's own checks print."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from disttrain.config.typed import field_type, unknown_key
from disttrain.errors import ConfigError

COMPOSITION_ERRORS = (HydraException, OmegaConfBaseException)
"""What Hydra raises while composing a config from its files and the command line's overrides."""


def composition_error_line(err: BaseException, overrides: Sequence[str]) -> str:
    """One line naming the key, the value and what is allowed, for an error Hydra raised while composing
    ``overrides``; an error of another shape keeps Hydra's words, joined on one line."""
    if isinstance(err, MissingConfigException) and err.options is not None and err.missing_cfg_file:
        group, _, option = err.missing_cfg_file.rpartition("/")
        return str(ConfigError(group, option, f"one of {err.options}" if err.options else "no options"))
    if isinstance(err, OverrideParseException):
        return f"cannot read the override {err.override!r}: {_first_line(err.message)} " \
               "(syntax: https://hydra.cc/docs/advanced/override_grammar/basic/)"
    cause = err.__cause__ if isinstance(err.__cause__, OmegaConfBaseException) else err
    full_key = getattr(cause, "full_key", None)
    schema = getattr(cause, "object_type", None)
    if full_key and dataclasses.is_dataclass(schema):
        value = _override_value(full_key, overrides)
        if isinstance(cause, (ConfigAttributeError, ConfigKeyError)):
            return str(unknown_key(full_key, value, [field.name for field in dataclasses.fields(schema)]))
        name = full_key.rpartition(".")[2]
        return str(ConfigError(full_key, value, f"expected {field_type(schema, name)}; {_first_line(str(cause))}"))
    return " ".join(" ".join(str(part).split()) for part in (err, err.__cause__) if part is not None)


def _override_value(full_key: str, overrides: Sequence[str]) -> Any:
    """The value the command line gave ``full_key`` (its last override), as typed; None if none did."""
    value = None
    for override in overrides:
        key, sep, given = override.partition("=")
        if sep and key.lstrip("~+") == full_key:
            value = given
    return value


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else text
