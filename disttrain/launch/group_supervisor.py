"""The job process as the supervisor of torchft replica groups (``fault_tolerance.engine=torchft``).

Beside ``Supervisor`` (which restarts every rank when one fails), this one treats a replica group as the unit of
failure: it runs the lighthouse that forms each step's quorum, gives every group its own store and rank
variables, and when a rank fails it kills and restarts that rank's group alone (``max_restarts`` times per
group); the other groups are never signalled and train on. A group of one rank cannot notice that it is
stopped, so the job also reads each group's heartbeats in the group's store and replaces a group silent for
``hang_timeout_s``; by then the others have left it behind after ``fault_tolerance.timeout_s``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from disttrain.fault.config import (
    NON_FINITE_EXIT,
    PREEMPTED_EXIT,
    PREEMPTION_SIGNALS,
    RESTARTS_FILE,
    FaultToleranceConfig,
)
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
from disttrain.launch.bookkeeping import keep_record
from disttrain.launch.supervisor import (
    POLL_S,
    Failure,
    RankProcess,
    RanksStopped,
    launch_rank,
    threads_per_rank,
    wait_for_an_exit,
)


@dataclass
class GroupFailure(Failure):
    """A failure that ended one replica group's attempt (``rank`` is the rank within the group)."""

    group: int = 0
    """The replica group."""
    time: float = 0.0
    """When it failed (seconds since the epoch): the exit seen, or a hung group's last heartbeat."""
    step: int | None = None
    """The steps it had committed when it failed (its ranks' last heartbeats), where any rank beat."""


class Group:
    """One replica group's running ranks, store and restart count."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.attempt = 0
        self.procs: list[RankProcess] = []
        self.store: Any = None
        self.finished = False
        """All its ranks exited 0 (or saved and stopped after a preemption signal)."""
        self.down = False
        """It failed with no restart left."""

    @property
    def running(self) -> bool:
        """Whether its ranks are supervised now."""
        return not (self.finished or self.down)

    def kill(self) -> None:
        """SIGKILL every rank still running (a stopped one yields to nothing else) and wait for them."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()


class GroupSupervisor:
    """Runs ``groups`` replica groups of ``group_size`` ranks each, restarting a failed group alone."""

    def __init__(self, groups: int, group_size: int, config_path: Path, log_dir: Path, ft: FaultToleranceConfig,
                 fork_ranks: bool) -> None:
        self.groups = [Group(g) for g in range(groups)]
        self.group_size, self.config_path, self.log_dir, self.ft = group_size, config_path, log_dir, ft
        self.fork_ranks = fork_ranks
        self.failures: list[GroupFailure] = []
        self._lighthouse: Any = None
        self._job_store: Any = None

    def run(self) -> int:
        """Supervise until every group has finished or is down for good; the number of group restarts.

        Raises ``RanksStopped`` when no group finished, and ``Preempted`` when the groups saved and stopped on a
        preemption signal."""
        from disttrain.parallel.store import LOOPBACK, hosted_store

        self.log_dir.mkdir(parents=True, exist_ok=True)
        for stale in (RESTARTS_FILE, MEMBERSHIP_FILE):
            (self.log_dir / stale).unlink(missing_ok=True)
        os.environ.setdefault("RUST_LOG", "error")  # torchft's servers log every quorum otherwise
        address = self.ft.lighthouse or self._start_lighthouse()
        self._job_store = hosted_store(LOOPBACK, 0)  # every group runs on this machine
        forwarded = {sig: signal.getsignal(sig) for sig in PREEMPTION_SIGNALS}
        for sig in forwarded:
            signal.signal(sig, self._forward)
        try:
            for group in self.groups:
                self._start(group, address)
            self._watch(address)
        finally:
            for group in self.groups:
                group.kill()
            for sig, handler in forwarded.items():
                signal.signal(sig, handler)
            if self._lighthouse is not None:
                self._lighthouse.shutdown()
        if not any(group.finished for group in self.groups):
            last = self.failures[-1]
            raise RanksStopped(f"{last.describe()}\nno replica group finished", 1)
        return len(self.failures)

    def _start_lighthouse(self) -> str:
        from torchft.coordination import LighthouseServer

        from disttrain.parallel.store import LOOPBACK

        ft = self.ft
        self._lighthouse = LighthouseServer(  # its groups run on this machine: loopback, not every interface
            bind=f"{LOOPBACK}:0", min_replicas=ft.min_groups, join_timeout_ms=int(1e3 * ft.join_timeout_s),
            heartbeat_timeout_ms=int(1e3 * ft.heartbeat_timeout_s))
        # its own address names this machine's host name, which may resolve to an interface it does not listen on
        return f"http://{LOOPBACK}:{self._lighthouse.address().rsplit(':', 1)[1]}"

    def _start(self, group: Group, lighthouse: str, fault_time: float | None = None) -> None:
        """Start ``group``'s ranks on a fresh store (a restarted group's ranks must not read the old one's keys);
        ``fault_time``: when its previous start failed."""
        from disttrain.parallel.store import LOOPBACK, hosted_store

        group.store = hosted_store(LOOPBACK, 0)
        size = self.group_size
        base = {"MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(group.store.port), "WORLD_SIZE": str(size),
                "NODE_RANK": "0", "LOCAL_WORLD_SIZE": str(size), "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_RESTART_COUNT": str(group.attempt),
                "TORCHELASTIC_MAX_RESTARTS": str(self.ft.max_restarts),
                GROUP_VAR: str(group.index), GROUPS_VAR: str(len(self.groups)), LIGHTHOUSE_VAR: lighthouse,
                JOB_STORE_VAR: f"{LOOPBACK}:{self._job_store.port}",
                **({FAULT_TIME_VAR: repr(fault_time)} if fault_time is not None else {}),
                **threads_per_rank(size * len(self.groups))}
        group.procs = [self._launch(group, rank, {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)})
                       for rank in range(size)]

    def _log_path(self, group: int, rank: int) -> Path:
        return self.log_dir / f"group{group}" / f"rank{rank}.log"

    def _launch(self, group: Group, rank: int, env: dict[str, str]) -> RankProcess:
        """Rank 0 of group 0 writes to the job's terminal; every other rank to ``logs/group<g>/rank<r>.log``."""
        env = {**os.environ, **env}
        if group.index == 0 and rank == 0:
            return launch_rank(self.config_path, self.fork_ranks, env, None)
        path = self._log_path(group.index, rank)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as log:
            if group.attempt:
                log.write(f"--- restart {group.attempt} ---\n")
                log.flush()
            return launch_rank(self.config_path, self.fork_ranks, env, log.fileno())

    def _watch(self, lighthouse: str) -> None:
        while any(group.running for group in self.groups):
            for group in self.groups:
                if not group.running:
                    continue
                failure = self._exited(group) or self._hung(group)
                if failure is None:
                    continue
                group.kill()
                self._record(failure)
                if failure.code == NON_FINITE_EXIT:  # the same numbers reach every group: nothing to go on with
                    raise RanksStopped(f"{failure.describe()}\nthe run stopped", NON_FINITE_EXIT)
                if group.attempt >= self.ft.max_restarts:
                    group.down = True
                    print(f"disttrain: replica group {group.index}: {failure.describe()}\ndisttrain: group "
                          f"{group.index} has no restart left ({self.ft.max_restarts}); the others go on",
                          file=sys.stderr, flush=True)
                    continue
                group.attempt += 1
                print(f"disttrain: replica group {group.index}: {failure.describe()}\ndisttrain: restarting group "
                      f"{group.index} ({group.attempt} of {self.ft.max_restarts}); it copies its state from a live "
                      "group", file=sys.stderr, flush=True)
                self._start(group, lighthouse, failure.time)
            wait_for_an_exit([proc for group in self.groups if group.running for proc in group.procs], POLL_S)
        if any(group.finished for group in self.groups) and all(
                proc.poll() in (0, PREEMPTED_EXIT) for group in self.groups if group.finished for proc in group.procs) \
                and any(proc.poll() == PREEMPTED_EXIT for group in self.groups for proc in group.procs):
            raise Preempted(None)

    def _exited(self, group: Group) -> GroupFailure | None:
        """The failure of a rank of ``group`` that exited with an error (a signal first), if any."""
        codes = [proc.poll() for proc in group.procs]
        if all(code in (0, PREEMPTED_EXIT) for code in codes):
            group.finished = True
            return None
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0, PREEMPTED_EXIT)]
        if not failed:
            return None
        rank, code = min(failed, key=lambda f: (f[1] >= 0, f[0]))
        return GroupFailure(group.attempt, rank, code, None, self._tail(group.index, rank), group=group.index,
                            time=time.time(), step=self._steps_done(group))

    def _beats(self, group: Group) -> dict[int, tuple[float, int | None]]:
        """Each beating rank's last heartbeat in ``group``'s store: (time, steps committed)."""
        beats = {}
        for rank in range(self.group_size):
            key = f"{BEAT_KEY}{rank}"
            try:
                if group.store.check([key]):  # not beating yet: still starting
                    beats[rank] = read_beat(group.store.get(key))
            except Exception:  # noqa: BLE001 - the store is this process's own; a failed read is no verdict
                continue
        return beats

    def _steps_done(self, group: Group) -> int | None:
        """The steps ``group`` had committed by its ranks' last heartbeats (None before any rank beat)."""
        steps = [step for _, step in self._beats(group).values() if step is not None]
        return max(steps) if steps else None

    def _hung(self, group: Group) -> GroupFailure | None:
        """A rank of ``group`` whose heartbeat is older than ``hang_timeout_s`` (stopped, frozen), if any."""
        timeout = self.ft.hang_timeout_s
        if not timeout:
            return None
        now = time.time()
        beats = self._beats(group)
        for rank, (last, _) in beats.items():
            if now - last > timeout:
                steps = [step for _, step in beats.values() if step is not None]
                return GroupFailure(group.attempt, rank, None,
                                    f"hung: rank {rank} of replica group {group.index} sent no heartbeat for "
                                    f"{now - last:.1f} s (stopped or frozen)", self._tail(group.index, rank),
                                    exit="was killed as hung", group=group.index, time=last,
                                    step=max(steps) if steps else None)
        return None

    def _record(self, failure: GroupFailure) -> None:
        """Keep the failure in ``logs/restarts.json`` and as a line of ``logs/membership.jsonl``."""
        self.failures.append(failure)
        keep_record(self.log_dir / RESTARTS_FILE, json.dumps([asdict(f) for f in self.failures], indent=2))
        line = {"event": "group_failed", "group": failure.group, "attempt": failure.attempt,
                "cause": failure.cause or f"rank {failure.rank} {failure.exit}", "time": failure.time,
                "step": failure.step}
        keep_record(self.log_dir / MEMBERSHIP_FILE, json.dumps(line) + "\n", append=True)

    def _tail(self, group: int, rank: int, lines: int = 15) -> list[str]:
        path = self._log_path(group, rank)
        if not path.exists():
            return []  # rank 0 of group 0 wrote to the terminal, above this message
        text = path.read_text(errors="replace").split("--- restart ")[-1]
        return text.strip().splitlines()[-lines:]

    def _forward(self, signum: int, _frame: object) -> None:
        for group in self.groups:
            for proc in group.procs:
                if proc.poll() is None:
                    proc.send_signal(signum)
