"""The ``fault_tolerance`` config node and the exit codes that tell a launcher or a scheduler why ranks stopped."""

from __future__ import annotations

import signal
from dataclasses import dataclass

from disttrain import checks
from disttrain.errors import ConfigError, SaveFailed

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""A preemption notice: the job forwards them to every rank, which saves a checkpoint and stops."""

PREEMPTED_EXIT = 75
"""All ranks saved a checkpoint after SIGTERM/SIGUSR1 and stopped (EX_TEMPFAIL: run again to continue)."""
HUNG_EXIT = 124
"""A rank stopped answering or no rank made progress within ``hang_timeout_s`` (as timeout(1) exits)."""
NON_FINITE_EXIT = 65
"""A non-finite loss or gradient norm under ``nan_policy=stop`` (EX_DATAERR)."""
SAVE_FAILED_EXIT = SaveFailed.exit_code
"""A checkpoint could not be written (a full disk, a lost mount): its partial folder is removed, the last good
checkpoint kept. Not restarted: the same save would fail again."""
LOST_PEER_EXIT = 69
"""A rank's collective failed because another rank went away: a consequence, never the cause (EX_UNAVAILABLE)."""
NAN_POLICIES = ("stop", "skip")
NAN_CHECKS = ("auto", "now", "next_step")
"""``fault_tolerance.nan_check``: when the gradient norm's finiteness is read."""
ENGINES = ("restart", "torchft")
"""How failures are survived: restart every rank from a checkpoint, or keep training in torchft replica groups."""
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
    nan_check: str = "auto"
    """When a step's gradient norm is checked: now (one value read back to the host in every step); next_step
    (where torch's fused AdamW, Adam or SGD drops a non-finite step on the device, from a flag it reads in its own
    kernel: the host reads the norm at the next step, a checkpoint save or the end of training, and never waits
    for the device in between); auto: next_step on a GPU, where each read stalls the host until the GPU is done,
    now on a CPU, where the flag's extra operations cost more than the read."""

    engine: str = "restart"
    """restart: a failed rank stops all ranks, which restart from the newest checkpoint (``max_restarts``);
    torchft: every replica of ``parallel.dp_replicate`` is a replica group that trains on when another fails; a
    failed group alone is restarted (``max_restarts`` times per group) and copies its state from a live one
    (needs the ``torchft`` extra: ``pip install disttrain[torchft]``)."""
    lighthouse: str | None = None
    """engine=torchft: address of a running torchft lighthouse (``http://host:port``); null: the job starts one
    in its own process."""
    min_groups: int = 1
    """engine=torchft: replica groups that must take part in a step for it to count (1 to parallel.dp_replicate);
    with fewer the others wait up to ``quorum_timeout_s``."""
    heartbeat_timeout_s: float = 5.0
    """engine=torchft: a group whose heartbeats stop this long is left out of the next step; a dead group delays
    the others by up to this much."""
    join_timeout_s: float = 60.0
    """engine=torchft: how long a step's quorum waits for groups that are alive but have not asked to join it."""
    quorum_timeout_s: float = 60.0
    """engine=torchft: how long a group waits for a quorum (too few groups alive) before it fails; must exceed
    the longest pause between steps (evaluation, checkpoint saves)."""
    timeout_s: float = 60.0
    """engine=torchft: the cross-group all-reduce, commit vote and state transfer give up after this long, and a
    hung group is left behind; below ``parallel.timeout_s``."""

    def validate(self, collective_timeout_s: int) -> None:
        """Raise ConfigError on a value outside its range."""
        checks.one_of("fault_tolerance.engine", self.engine, ENGINES)
        if self.min_groups < 1:
            raise ConfigError("fault_tolerance.min_groups", self.min_groups, "1 or more replica groups")
        for key in ("heartbeat_timeout_s", "join_timeout_s", "quorum_timeout_s", "timeout_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"fault_tolerance.{key}", getattr(self, key), "a positive number of seconds")
        if self.engine == "torchft" and self.timeout_s >= collective_timeout_s:
            raise ConfigError("fault_tolerance.timeout_s", self.timeout_s,
                              f"below parallel.timeout_s={collective_timeout_s} (a group's own collectives must "
                              "outlast the cross-group ones, or a hung peer group ends the group as well)")
        if self.lighthouse is not None and not str(self.lighthouse).startswith(("http://", "https://")):
            raise ConfigError("fault_tolerance.lighthouse", self.lighthouse,
                              "null (the job starts a lighthouse) or an address http://host:port")
        if self.max_restarts < 0:
            raise ConfigError("fault_tolerance.max_restarts", self.max_restarts, "0 or more")
        if self.hang_timeout_s < 0:
            raise ConfigError("fault_tolerance.hang_timeout_s", self.hang_timeout_s, "0 (off) or more seconds")
        if self.hang_timeout_s >= collective_timeout_s:
            raise ConfigError("fault_tolerance.hang_timeout_s", self.hang_timeout_s,
                              f"below parallel.timeout_s={collective_timeout_s} (a hang would otherwise end "
                              "as a collective timeout first)")
        checks.one_of("fault_tolerance.nan_policy", self.nan_policy, NAN_POLICIES)
        checks.one_of("fault_tolerance.nan_check", self.nan_check, NAN_CHECKS)

    def resolve_nan_check(self, uses_gpu: bool) -> None:
        """Decide ``nan_check=auto`` for the device the ranks train on (before they start)."""
        if self.nan_check == "auto":
            self.nan_check = "next_step" if uses_gpu else "now"
