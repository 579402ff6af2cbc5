"""The step's phases, marked by code that runs them itself: a pipeline schedule runs every micro-batch's forward and
backward inside one call of the training step, where Lightning's ``on_before_backward`` and ``on_after_backward``
do not fire.

Process-wide, as the collective recorder is: the straggler detector listens while a rank trains (``listener``); a
pipeline's stages mark their compute and their loss (``disttrain.parallel.pipeline.phases``). Inside a schedule's
training step, time outside the stages' compute is the schedule's transfers: sending to and waiting for the
neighbouring stages' activations and gradients, counted as ``collectives`` (waiting, never blamed). With nobody
listening a mark costs an attribute read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

WAITING_PHASE = "collectives"
"""The phase the time between a schedule's compute blocks is closed as (``disttrain.observe.stragglers.PHASES``)."""


class PhaseMarks:
    """Tells ``listener`` the name of each phase as it ends, while a schedule's training step runs."""

    def __init__(self) -> None:
        self.listener: Callable[[str], None] | None = None
        """Called with the name of the phase ending now (the straggler detector's clock); None: nobody listens."""
        self._in_step = False
        self._depth = 0  # compute blocks open (a block inside another marks nothing)

    @contextmanager
    def schedule_step(self) -> Iterator[None]:
        """A schedule's training step runs in the block; its time after the last compute block was waiting."""
        if self.listener is None:
            yield
            return
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False
            if self.listener is not None:
                self.listener(WAITING_PHASE)

    @contextmanager
    def compute(self, phase: str) -> Iterator[None]:
        """A stage's forward, loss or backward runs in the block: inside a schedule's training step, the time
        since the last mark was waiting, and the block's is ``phase``."""
        listener = self.listener if self._in_step and self._depth == 0 else None
        if listener is None:
            yield
            return
        listener(WAITING_PHASE)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            listener(phase)


PHASE_MARKS = PhaseMarks()
"""This process's marks (one training thread per process)."""
