"""Users' own callables named by ``_target_`` (models, data): found and called with one-line errors.

Hydra's ``instantiate`` does the call (nested ``_target_`` arguments included); locating the callable is
done here because Hydra's ``get_object`` logs an error of its own before raising, and a user should see
one line.
"""

from __future__ import annotations

import importlib
from typing import Any

from disttrain.errors import ConfigError


def locate(path: str, key: str) -> Any:
    """The callable at dotted ``path``; ConfigError naming ``key`` and what is missing."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module_name)
        except Exception as err:  # noqa: BLE001  (the user's module failed while importing; say how)
            if isinstance(err, ModuleNotFoundError) and err.name and module_name.startswith(err.name):
                continue  # not a module: try a shorter prefix
            raise ConfigError(key, path, f"an importable callable; importing {module_name} failed: "
                              f"{describe_error(err)}") from None
        for depth, attribute in enumerate(parts[cut:], start=cut):
            if not hasattr(obj, attribute):
                raise ConfigError(key, path, f"an importable callable; {'.'.join(parts[:depth])} has no "
                                  f"attribute {attribute!r}")
            obj = getattr(obj, attribute)
        if not callable(obj):
            raise ConfigError(key, path, f"a callable, not a {type(obj).__name__}")
        return obj
    raise ConfigError(key, path, f"an importable callable; there is no module {parts[0]!r}")


def call(path: str, kwargs: dict[str, Any], key: str, what: str) -> Any:
    """``path(**kwargs)`` through Hydra's ``instantiate``; a ConfigError naming ``key`` (``what`` it must be,
    and the exception the call raised) if it fails."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    locate(path, key)
    try:
        return instantiate({"_target_": path, **kwargs}, _convert_="all")
    except InstantiationException as err:
        raise ConfigError(key, path, f"{what}; calling it raised {describe_error(err)}") from None


def describe_error(err: BaseException) -> str:
    """The innermost cause's type and first line, which is what a user needs to fix."""
    while err.__cause__ is not None:
        err = err.__cause__
    first = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return f"{type(err).__name__}: {first}" if first else type(err).__name__
