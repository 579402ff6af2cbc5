"""The options of ``callbacks=memory`` and their check, made before any rank starts."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from disttrain.errors import ConfigError

MEMORY_CALLBACK = "disttrain.observe.memory_callback.StepMemoryCallback"
"""The ``_target_`` of ``conf/callbacks/memory.yaml``'s node."""


@dataclass(frozen=True)
class MemoryStepOptions:
    """Which optimiser step is recorded, where its files go and how many holders they name."""

    step: int = 1
    """Optimiser steps done before the recorded one (0: the first; the default, the second, holds the optimiser's
    state, as every later step does)."""
    dirpath: str | None = None
    """Where ``memory_step.json`` and ``memory_step.png`` go; null: ``logs/`` and ``plots/`` of the run folder."""
    largest: int = 10
    """How many of the largest tensors alive at the peak the record names."""

    def check(self, key: str, max_steps: int = -1) -> None:
        """Raise ConfigError naming ``key.<field>`` for a value outside its range (``max_steps``: the run's
        ``trainer.max_steps``, -1 for no limit)."""
        if not isinstance(self.step, int) or isinstance(self.step, bool) or self.step < 0:
            raise ConfigError(f"{key}.step", self.step, "an optimiser step: 0 (the first) or more")
        if max_steps != -1 and self.step >= max_steps:
            raise ConfigError(f"{key}.step", self.step, f"a step the run takes: below trainer.max_steps={max_steps}")
        if not isinstance(self.largest, int) or isinstance(self.largest, bool) or self.largest < 1:
            raise ConfigError(f"{key}.largest", self.largest, "1 or more tensors")
        if self.dirpath is not None and not isinstance(self.dirpath, str):
            raise ConfigError(f"{key}.dirpath", self.dirpath, "a folder, or null for the run folder's logs/ and plots/")


def check_memory_callbacks(callbacks: Mapping[str, Any], max_steps: int) -> None:
    """Check the options of every ``callbacks`` node that is the memory callback: an unknown option or a value
    outside its range is one ConfigError naming ``callbacks.<name>.<option>``."""
    allowed = [field.name for field in fields(MemoryStepOptions)]
    for name, node in callbacks.items():
        if not isinstance(node, Mapping) or node.get("_target_") != MEMORY_CALLBACK:
            continue
        options = {key: value for key, value in node.items() if key != "_target_"}
        for key in options:
            if key not in allowed:
                raise ConfigError(f"callbacks.{name}.{key}", options[key], f"one of the options {allowed}")
        MemoryStepOptions(**options).check(f"callbacks.{name}", max_steps)
