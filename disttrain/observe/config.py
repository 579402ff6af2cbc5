"""The ``observe`` config node: how the ranks watch each other's speed while training."""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.errors import ConfigError


@dataclass
class ObserveConfig:
    """Straggler detection: every ``trainer.log_every_n_steps`` steps the ranks exchange their step phases."""

    stragglers: bool = True
    """Name a rank that is slower than the others (runs whose ranks step in lockstep: data, tensor, pipeline
    parallelism and ZeRO; one all-gather of a few numbers per logging window)."""
    straggler_ratio: float = 1.2
    """A rank is slow in a phase (data, forward, backward, optimiser) or its step without its waits when, in its
    fastest step of a logging window, it exceeds the median rank's fastest by this factor (and by more than a tenth
    of the step and than the rank's own spread over the window: ``disttrain.observe.stragglers.slow_ranks``)."""
    straggler_windows: int = 2
    """Logging windows in a row a rank must be slow in before it is named (one slow window is often a hiccup)."""

    def validate(self) -> None:
        """Raise ConfigError on a value outside its range."""
        if not self.straggler_ratio > 1.0:
            raise ConfigError("observe.straggler_ratio", self.straggler_ratio,
                              "a number above 1 (1.2: 20% slower than the median rank)")
        if self.straggler_windows < 1:
            raise ConfigError("observe.straggler_windows", self.straggler_windows, "1 or more logging windows")
