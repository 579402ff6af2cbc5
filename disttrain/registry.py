"""Name -> (config schema, builder) registries, so configs name components instead of import paths."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from disttrain.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True)
class Entry(Generic[T]):
    """One registered component: its typed config schema and the function that builds it."""

    schema: type
    """The dataclass its config node is checked against."""
    builder: Callable[..., T]
    """Builds the component from a config of that schema."""


class Registry(Generic[T]):
    """Maps a component name (the config's ``name`` field) to its schema and builder."""

    def __init__(self, group: str) -> None:
        self.group = group
        self._entries: dict[str, Entry[T]] = {}

    def register(self, name: str, schema: type) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Decorator: register ``builder`` under ``name`` with its config ``schema``."""

        def wrap(builder: Callable[..., T]) -> Callable[..., T]:
            if name in self._entries:
                raise KeyError(f"{self.group} '{name}' is registered twice")
            self._entries[name] = Entry(schema, builder)
            return builder

        return wrap

    def names(self) -> list[str]:
        """All registered names, sorted."""
        return sorted(self._entries)

    def get(self, name: str) -> Entry[T]:
        """The entry for ``name``; a ConfigError listing the known names if there is none."""
        if name not in self._entries:
            raise ConfigError(f"{self.group}.name", name, f"one of {self.names()}")
        return self._entries[name]

    def build(self, cfg: Any, *args: Any, **kwargs: Any) -> T:
        """Build the component that the typed config ``cfg`` (with a ``name`` field) describes."""
        return self.get(cfg.name).builder(cfg, *args, **kwargs)
