"""The restart policy of torchft replica groups (``fault_tolerance.engine=torchft``): a replica group is the unit of
failure. The job runs the lighthouse that forms each step's quorum, and when a rank fails it kills and restarts that
rank's group alone (``max_restarts`` times per group); the other groups are never signalled and train on. A group of
one rank cannot notice that it is stopped, so the job also reads each group's heartbeats in the group's store and
replaces a group silent for ``hang_timeout_s``; by then the others have left it behind after
``fault_tolerance.timeout_s``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disttrain.fault.config import NON_FINITE_EXIT, PREEMPTED_EXIT, RESTARTS_FILE, FaultToleranceConfig
from disttrain.fault.replica_groups import (
    BEAT_KEY,
    FAULT_TIME_VAR,
    GROUP_VAR,
    GROUPS_VAR,
    JOB_STORE_VAR,
    LIGHTHOUSE_VAR,
    MEMBERSHIP_FILE,
    read_beat,
)
from disttrain.fault.stops import Preempted
from disttrain.launch.supervisor import Failure, RankGroup, RanksStopped, Supervisor
from disttrain.records import keep_record


@dataclass
class GroupFailure(Failure):
    """A failure that ended one replica group's attempt (``rank`` is the rank within the group)."""

    group: int = 0
    """The replica group."""
    time: float = 0.0
    """When it failed (seconds since the epoch): the exit seen, or a hung group's last heartbeat."""
    step: int | None = None
    """The steps it had committed when it failed (its ranks' last heartbeats), where any rank beat."""


class RestartGroup(Supervisor):
    """Runs ``groups`` replica groups of ``group_size`` ranks each, restarting a failed group alone."""

    records = (RESTARTS_FILE, MEMBERSHIP_FILE)
    failures: list[GroupFailure]

    def __init__(self, groups: int, group_size: int, config_path: Path, log_dir: Path, ft: FaultToleranceConfig,
                 fork_ranks: bool) -> None:
        super().__init__([RankGroup(g, group_size, log_dir / f"group{g}") for g in range(groups)], config_path,
                         log_dir, ft.max_restarts, fork_ranks)
        self.ft = ft
        self._lighthouse_address = ""
        """The lighthouse's address, once the run starts: the user's, or that of the one this job runs."""
        self._lighthouse_server: Any = None
        self._job_store: Any = None

    def run(self) -> int:
        """Supervise until every group has finished or is down for good; the number of group restarts.

        Raises ``RanksStopped`` when no group finished, and ``Preempted`` when the groups saved and stopped on a
        preemption signal."""
        from disttrain.parallel.store import LOOPBACK, hosted_store

        os.environ.setdefault("RUST_LOG", "error")  # torchft's servers log every quorum otherwise
        try:
            self._lighthouse_address = self.ft.lighthouse or self._start_lighthouse()
            self._job_store = hosted_store(LOOPBACK, 0)  # every group runs on this machine
            restarts = super().run()
        finally:
            if self._lighthouse_server is not None:
                self._lighthouse_server.shutdown()
        if not any(group.finished for group in self.groups):
            raise RanksStopped(f"{self.failures[-1].describe()}\nno replica group finished", 1)
        if any(PREEMPTED_EXIT in group.codes() for group in self.groups):  # the others saved and stopped too
            raise Preempted(None)
        return restarts

    def _start_lighthouse(self) -> str:
        from torchft.coordination import LighthouseServer

        from disttrain.parallel.store import LOOPBACK

        ft = self.ft
        self._lighthouse_server = LighthouseServer(  # its groups run on this machine: loopback, not every interface
            bind=f"{LOOPBACK}:0", min_replicas=ft.min_groups, join_timeout_ms=int(1e3 * ft.join_timeout_s),
            heartbeat_timeout_ms=int(1e3 * ft.heartbeat_timeout_s))
        # its own address names this machine's host name, which may resolve to an interface it does not listen on
        return f"http://{LOOPBACK}:{self._lighthouse_server.address().rsplit(':', 1)[1]}"

    def _group_env(self, group: RankGroup) -> dict[str, str]:
        """The group's place among the others, the lighthouse, the job's store and, for a restarted group, when its
        previous start failed."""
        from disttrain.parallel.store import LOOPBACK

        failed_at = [failure.time for failure in self.failures if failure.group == group.index]
        return {GROUP_VAR: str(group.index), GROUPS_VAR: str(len(self.groups)),
                LIGHTHOUSE_VAR: self._lighthouse_address, JOB_STORE_VAR: f"{LOOPBACK}:{self._job_store.port}",
                **({FAULT_TIME_VAR: repr(failed_at[-1])} if failed_at else {})}

    def _failure(self, group: RankGroup) -> GroupFailure | None:
        """A rank of ``group`` that exited with an error (a signal first), else one whose heartbeat is older than
        ``hang_timeout_s`` (stopped, frozen), if any."""
        codes = group.codes()
        if all(code in (0, PREEMPTED_EXIT) for code in codes):
            group.finished = True
            return None
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0, PREEMPTED_EXIT)]
        if failed:
            rank, code = min(failed, key=lambda f: (f[1] >= 0, f[0]))
            return GroupFailure(group.attempt, rank, code, None, group.tail(rank), group=group.index,
                                time=time.time(), step=steps_done(self._beats(group)))
        timeout = self.ft.hang_timeout_s
        beats = self._beats(group) if timeout else {}
        now = time.time()
        for rank, (last, _) in beats.items():
            if now - last > timeout:
                return GroupFailure(group.attempt, rank, None,
                                    f"hung: rank {rank} of replica group {group.index} sent no heartbeat for "
                                    f"{now - last:.1f} s (stopped or frozen)", group.tail(rank),
                                    exit="was killed as hung", group=group.index, time=last, step=steps_done(beats))
        return None

    def _recover(self, group: RankGroup, failure: GroupFailure) -> None:
        """Restart the failed group alone, or leave it down when it has no restart left; non-finite numbers stop
        the run."""
        if failure.code == NON_FINITE_EXIT:  # the same numbers reach every group: nothing to go on with
            raise RanksStopped(f"{failure.describe()}\nthe run stopped", NON_FINITE_EXIT)
        said = f"disttrain: replica group {group.index}: {failure.describe()}\ndisttrain: "
        if group.attempt >= self.max_restarts:
            group.down = True
            print(f"{said}group {group.index} has no restart left ({self.max_restarts}); the others go on",
                  file=sys.stderr, flush=True)
            return
        group.attempt += 1
        print(f"{said}restarting group {group.index} ({group.attempt} of {self.max_restarts}); it copies its state "
              "from a live group", file=sys.stderr, flush=True)
        self._start(group)

    def _beats(self, group: RankGroup) -> dict[int, tuple[float, int | None]]:
        """Each beating rank's last heartbeat in ``group``'s store: (time, steps committed)."""
        beats = {}
        for rank in range(group.size):
            key = f"{BEAT_KEY}{rank}"
            try:
                if group.store.check([key]):  # not beating yet: still starting
                    beats[rank] = read_beat(group.store.get(key))
            except Exception:  # noqa: BLE001 - the store is this process's own; a failed read is no verdict
                continue
        return beats

    def _record(self, failure: GroupFailure) -> None:
        """Keep the failure in ``logs/restarts.json`` and as a line of ``logs/membership.jsonl``."""
        super()._record(failure)
        line = {"event": "group_failed", "group": failure.group, "attempt": failure.attempt,
                "cause": failure.cause or f"rank {failure.rank} {failure.exit}", "time": failure.time,
                "step": failure.step}
        keep_record(self.log_dir / MEMBERSHIP_FILE, json.dumps(line) + "\n", append=True)


def steps_done(beats: dict[int, tuple[float, int | None]]) -> int | None:
    """The steps a group had committed by its ranks' last heartbeats ``beats`` (None before any rank beat)."""
    steps = [step for _, step in beats.values() if step is not None]
    return max(steps) if steps else None
