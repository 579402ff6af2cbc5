"""The ``fault_tolerance`` config node and the exit codes that tell a launcher or a scheduler why ranks stopped."""

from __future__ import annotations

import signal
from dataclasses import dataclass

from disttrain.errors import ConfigError

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""A preemption notice: the job forwards them to every rank, which saves a checkpoint and stops."""

PREEMPTED_EXIT = 75
"""All ranks saved a checkpoint after SIGTERM/SIGUSR1 and stopped (EX_TEMPFAIL: run again to continue)."""
HUNG_EXIT = 124
"""A rank stopped answering or no rank made progress within ``hang_timeout_s`` (as timeout(1) exits)."""
NON_FINITE_EXIT = 65
"""A non-finite loss or gradient norm under ``nan_policy=stop`` (EX_DATAERR)."""
LOST_PEER_EXIT = 69
"""A rank's collective failed because another rank went away: a consequence, never the cause (EX_UNAVAILABLE)."""
NAN_POLICIES = ("stop", "skip")
RESTARTS_FILE = "restarts.json"
"""In the log folder: one record per restart (attempt, rank, exit, cause, end of log), written by the supervisor."""
FAILURE_KEY = "disttrain/failure"
"""Store key where a rank that detected a hang leaves its one-line diagnosis for the supervisor."""


def restart_count() -> int:
    """How many times the launcher restarted this run's ranks (torchrun's and disttrain's variable, or a
    SLURM requeue's); a restarted rank resumes from the newest complete checkpoint."""
    import os

    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("SLURM_RESTART_COUNT") or 0)


@dataclass
class FaultToleranceConfig:
    """What happens when a rank dies, hangs, is preempted, or a step produces non-finite numbers."""

    max_restarts: int = 0
    """Restarts of all ranks after a rank fails, each resuming from the newest complete checkpoint."""
    hang_timeout_s: float = 300.0
    """A rank silent, or all ranks without progress, for this long stops the job (0: never)."""
    nan_policy: str = "stop"
    """stop: a non-finite loss or gradient norm ends the run, keeping the last good checkpoint;
    skip: that step's update is dropped on every rank and counted."""

    def validate(self, collective_timeout_s: int) -> None:
        """Raise ConfigError on a value outside its range."""
        if self.max_restarts < 0:
            raise ConfigError("fault_tolerance.max_restarts", self.max_restarts, "0 or more")
        if self.hang_timeout_s < 0:
            raise ConfigError("fault_tolerance.hang_timeout_s", self.hang_timeout_s, "0 (off) or more seconds")
        if self.hang_timeout_s >= collective_timeout_s:
            raise ConfigError("fault_tolerance.hang_timeout_s", self.hang_timeout_s,
                              f"below parallel.timeout_s={collective_timeout_s} (a hang would otherwise end "
                              "as a collective timeout first)")
        if self.nan_policy not in NAN_POLICIES:
            raise ConfigError("fault_tolerance.nan_policy", self.nan_policy, f"one of {', '.join(NAN_POLICIES)}")
