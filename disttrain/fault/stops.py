"""How a step or a whole run stops: the exceptions that the ranks raise and the job process reports.

Apart from ``disttrain.fault.steps`` (which needs Lightning and torch.distributed), so that the job process can
catch them without importing Lightning, whose import takes seconds that a config error should not wait for.
"""

from __future__ import annotations

from disttrain.fault.config import NON_FINITE_EXIT, PREEMPTED_EXIT


class Preempted(SystemExit):
    """All ranks saved a checkpoint after a preemption signal and stop (exit status ``PREEMPTED_EXIT``): a clean,
    resumable stop, not an error."""

    def __init__(self, step: int | None) -> None:
        super().__init__(PREEMPTED_EXIT)
        self.step = step
        """The global step every rank saved (None where the job could not read it)."""

    @property
    def message(self) -> str:
        """The one line the job prints, for one rank and for many alike."""
        at = f" at step {self.step}" if self.step is not None else ""
        return (f"Preempted{at}: every rank saved a checkpoint and stopped; run the same command with resume=auto "
                "to continue")


class NonFiniteStep(RuntimeError):
    """A non-finite loss or gradient norm under ``nan_policy=stop``; the last good checkpoint is kept."""

    exit_code = NON_FINITE_EXIT


class SkippedStep(Exception):
    """Raised inside the optimiser closure to drop a step's update on every rank (``nan_policy=skip``)."""
