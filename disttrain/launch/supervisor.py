"""The job process as the ranks' supervisor: start groups of ranks, watch, stop and restart them, and say why.

torchrun's elastic agent does the same for its own command line but reports a failure only when the job ends,
prefixes or hides rank 0's terminal output, and cannot tell the restarted ranks which run directory to resume; this
supervisor keeps the run's directory, logs and terminal as they are and records each restart's cause. Each group of
ranks finds itself through a store hosted here, as under torchrun's agent (``TORCHELASTIC_USE_AGENT_STORE``), and
reads ``TORCHELASTIC_RESTART_COUNT`` as it would there. What a failure costs is the restart policy, a subclass:
``restart_all.RestartAll`` (every rank, restarted together) and ``restart_group.RestartGroup`` (torchft).
"""

from __future__ import annotations

import json
import multiprocessing.connection
import os
import shutil
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from disttrain.fault.config import (
    HUNG_EXIT,
    LOST_PEER_EXIT,
    NON_FINITE_EXIT,
    PREEMPTED_EXIT,
    PREEMPTION_SIGNALS,
    RESTARTS_FILE,
    SAVE_FAILED_EXIT,
)
from disttrain.launch.fork_server import ForkedRank
from disttrain.observe.hang import DUMP_KEY, REPORTS_FOLDER
from disttrain.observe.hang import summary as hang_summary
from disttrain.records import keep_record

RankProcess = subprocess.Popen | ForkedRank
"""A running worker rank: forked from the fork server, or a new interpreter where the platform has none."""

POLL_S = 0.2
REPORT_WAIT_S = 5.0
"""After SIGUSR2, how long the job waits for every rank's report before it prints what it has."""


def wait_for_an_exit(procs: Sequence[RankProcess], timeout: float) -> None:
    """Return as soon as one of ``procs`` that still run ends, or after ``timeout`` seconds: the job sees a run end
    (or a rank fail) when it happens, not up to a poll interval later. New interpreters are waited on through a
    process file descriptor where the platform has one (Linux), else for the whole ``timeout``."""
    running = [proc for proc in procs if proc.poll() is None]
    if not running:  # nothing left to wait for
        return
    opened = [os.pidfd_open(proc.pid) for proc in running if isinstance(proc, subprocess.Popen)
              and hasattr(os, "pidfd_open")]
    sentinels = [*opened, *(proc.sentinel for proc in running if isinstance(proc, ForkedRank))]
    try:
        if sentinels:
            multiprocessing.connection.wait(sentinels, timeout)
        else:
            time.sleep(timeout)
    finally:
        for fd in opened:
            os.close(fd)


class RanksStopped(RuntimeError):
    """The job's ranks stopped before finishing; ``exit_code`` says why (see ``disttrain.fault.config``)."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class Failure:
    """The first rank of an attempt that exited with an error, and what it left behind."""

    attempt: int
    """The attempt it ended (0: the first start)."""
    rank: int
    """The rank that failed first."""
    code: int | None
    """The rank's exit status (negative: the signal that killed it; None: it would not stop)."""
    cause: str | None = None
    """What went wrong, in one line, where a rank diagnosed it (a hang, a non-finite step)."""
    log_tail: list[str] = field(default_factory=list)
    """The last lines of its log."""
    exit: str = ""
    """``code`` in words."""
    found_by: int | None = None
    """For a hang: the rank whose watchdog saw it and exited with ``code`` (``rank`` is the one it blamed)."""

    def __post_init__(self) -> None:
        self.exit = self.exit or describe_exit(self.code)

    def describe(self) -> str:
        """One paragraph: what happened, which rank, and the end of its log."""
        text = f"{self.cause} (rank {self.rank} {self.exit})" if self.cause else f"rank {self.rank} {self.exit}"
        if self.log_tail:
            text += "; end of its log:\n" + "\n".join(self.log_tail)
        return text


MEANINGS = {HUNG_EXIT: "found a hang", NON_FINITE_EXIT: "stopped on non-finite numbers",
            SAVE_FAILED_EXIT: "could not write a checkpoint", PREEMPTED_EXIT:
            "was preempted", LOST_PEER_EXIT: "lost contact with another rank"}


def describe_exit(code: int | None) -> str:
    """``exited with code 1``, ``was killed by SIGKILL``, ``found a hang (exit 124)``."""
    if code is None:
        return "did not stop"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"{MEANINGS[code]} (exit {code})" if code in MEANINGS else f"exited with code {code}"


def print_hang_summary(folder: Path, world_size: int) -> None:
    """Print the ranks' reports in ``folder`` as one summary (nothing where no rank wrote one)."""
    for line in hang_summary(folder, world_size):
        print(f"disttrain: {line}", file=sys.stderr, flush=True)


def threads_per_rank(ranks: int) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for ranks sharing this machine's cores, unless the user set it: each rank's default
    (every core) oversubscribes them, and small steps then spend their time in threads waiting on each other
    (torchrun sets 1 for the same reason)."""
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"OMP_NUM_THREADS": str(max(1, cores // ranks))}


class RankGroup:
    """One group of ranks: its running processes, store, logs and restart count."""

    def __init__(self, index: int, size: int, log_dir: Path) -> None:
        self.index, self.size, self.log_dir = index, size, log_dir
        self.attempt = 0
        """Its restarts so far (``TORCHELASTIC_RESTART_COUNT``)."""
        self.procs: list[RankProcess] = []
        self.store: Any = None
        """The store its ranks find each other through, fresh at each start."""
        self.finished = False
        """All its ranks exited 0 (or saved and stopped after a preemption signal)."""
        self.down = False
        """It failed with no restart left."""

    @property
    def running(self) -> bool:
        """Whether its ranks are supervised now."""
        return not (self.finished or self.down)

    def codes(self) -> list[int | None]:
        """Each rank's exit status, None while it runs."""
        return [proc.poll() for proc in self.procs]

    def log_path(self, rank: int) -> Path | None:
        """Where ``rank`` writes; None for rank 0 of group 0, which speaks to the user: its output is the job's."""
        return None if self.index == 0 and rank == 0 else self.log_dir / f"rank{rank}.log"

    def tail(self, rank: int, lines: int = 15) -> list[str]:
        """The last ``lines`` lines ``rank`` logged since its latest start."""
        path = self.log_path(rank)
        if path is None or not path.exists():
            return []  # rank 0 wrote to the terminal, above this message
        text = path.read_text(errors="replace").split("--- restart ")[-1]
        return text.strip().splitlines()[-lines:]

    def kill(self) -> None:
        """SIGKILL every rank still running (a stopped one yields to nothing else) and wait for them."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()


class Supervisor(ABC):
    """Runs ``groups`` of worker ranks until each has finished or is down; a subclass is the restart policy: it
    finds a group's failure (``_failure``) and decides what it costs (``_recover``)."""

    records = (RESTARTS_FILE,)
    """The job's records in ``log_dir``, which a new run starts without."""

    def __init__(self, groups: list[RankGroup], config_path: Path, log_dir: Path, max_restarts: int,
                 fork_ranks: bool) -> None:
        self.groups, self.config_path, self.log_dir = groups, config_path, log_dir
        self.max_restarts, self.fork_ranks = max_restarts, fork_ranks
        self.failures: list[Failure] = []
        self._signalled = False
        self._reports_asked: float | None = None  # when SIGUSR2 asked the ranks for their reports
        self._requests = 0

    def run(self) -> int:
        """Supervise until every group has finished or is down; the number of restarts it took."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.records:
            (self.log_dir / stale).unlink(missing_ok=True)
        forwarded = {sig: signal.getsignal(sig) for sig in PREEMPTION_SIGNALS}
        for sig in forwarded:  # a preemption notice to the job reaches every rank, which save and stop
            signal.signal(sig, self._forward)
        shutil.rmtree(self.log_dir / REPORTS_FOLDER, ignore_errors=True)
        forwarded[signal.SIGUSR2] = signal.signal(signal.SIGUSR2, self._ask_reports)
        try:
            for group in self.groups:
                self._start(group)
            while any(group.running for group in self.groups):
                for group in self.groups:
                    failure = self._failure(group) if group.running else None
                    if failure is not None:
                        group.kill()
                        self._record(failure)
                        self._recover(group, failure)
                wait_for_an_exit([proc for group in self.groups if group.running for proc in group.procs], POLL_S)
                self._print_reports_when_ready()
            return len(self.failures)
        finally:
            for group in self.groups:
                group.kill()
                group.store = None
            for sig, handler in forwarded.items():
                signal.signal(sig, handler)

    @abstractmethod
    def _failure(self, group: RankGroup) -> Failure | None:
        """The failure that ends ``group``'s attempt, if any; sets ``group.finished`` once its ranks are done."""

    @abstractmethod
    def _recover(self, group: RankGroup, failure: Failure) -> None:
        """After ``group`` failed and was killed: start it again, mark it down, or raise to stop the run."""

    def _group_env(self, group: RankGroup) -> dict[str, str]:
        """Variables the policy adds to ``group``'s ranks."""
        return {}

    def _start(self, group: RankGroup) -> None:
        """Start ``group``'s ranks on a fresh store (a restarted group's ranks must not read the old one's keys)."""
        from disttrain.parallel.store import LOOPBACK, hosted_store

        group.store = hosted_store(LOOPBACK, 0)  # every rank runs on this machine
        base = {"MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(group.store.port), "WORLD_SIZE": str(group.size),
                "NODE_RANK": "0", "LOCAL_WORLD_SIZE": str(group.size), "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_RESTART_COUNT": str(group.attempt), "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
                **threads_per_rank(sum(each.size for each in self.groups)), **self._group_env(group)}
        group.procs = [self._launch(group, rank, {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)})
                       for rank in range(group.size)]

    def _launch(self, group: RankGroup, rank: int, env: dict[str, str]) -> RankProcess:
        """Start ``rank`` of ``group`` with ``env``: forked from the fork server or as a new interpreter, writing to
        the job's own output (rank 0 of group 0) or both its streams to its log, after a ``--- restart N ---`` line
        on a restart (``RankGroup.tail`` reads from the last one)."""
        env, path = {**os.environ, **env}, group.log_path(rank)
        command = [sys.executable, "-m", "disttrain.rank.run", str(self.config_path)]
        if path is None:
            return ForkedRank(self.config_path, env, 1, 2) if self.fork_ranks else subprocess.Popen(command, env=env)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as log:
            if group.attempt:
                log.write(f"--- restart {group.attempt} ---\n")
                log.flush()
            if self.fork_ranks:
                return ForkedRank(self.config_path, env, log.fileno(), log.fileno())
            return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)

    def _record(self, failure: Failure) -> None:
        """Keep ``failure`` in ``logs/restarts.json``."""
        self.failures.append(failure)
        keep_record(self.log_dir / RESTARTS_FILE, json.dumps([asdict(f) for f in self.failures], indent=2))

    def _ask_reports(self, _signum: int, _frame: object) -> None:
        """SIGUSR2: ask every rank for its stacks and last collective (through the store, which each rank's
        watchdog reads once a beat); the summary follows once they are written."""
        folder = self.log_dir / REPORTS_FOLDER
        shutil.rmtree(folder, ignore_errors=True)
        self._requests += 1
        for group in self.groups:
            if group.store is not None:
                group.store.set(DUMP_KEY, f"signal {self._requests}")
        self._reports_asked = time.monotonic()

    def _print_reports_when_ready(self) -> None:
        if self._reports_asked is None:
            return
        world = sum(group.size for group in self.groups)
        written = len(list((self.log_dir / REPORTS_FOLDER).glob("rank*.json")))
        if written < world and time.monotonic() - self._reports_asked < REPORT_WAIT_S:
            return
        self._reports_asked = None
        print_hang_summary(self.log_dir / REPORTS_FOLDER, world)

    def _forward(self, signum: int, _frame: object) -> None:
        self._signalled = True
        for group in self.groups:
            for proc in group.procs:
                if proc.poll() is None:
                    proc.send_signal(signum)
