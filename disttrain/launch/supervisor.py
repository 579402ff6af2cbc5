"""The job process as the ranks' supervisor: start, watch, stop and restart them, and say why.

torchrun's elastic agent does the same for its own command line but reports a failure only when the
job ends, prefixes or hides rank 0's terminal output, and cannot tell the restarted ranks which run
directory to resume; this supervisor keeps the run's directory, logs and terminal as they are and
records each restart's cause. Ranks find each other through a store hosted here, as under torchrun's
agent (``TORCHELASTIC_USE_AGENT_STORE``), and read ``TORCHELASTIC_RESTART_COUNT`` as they would there.
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
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from disttrain.fault.config import (
    FAILURE_KEY,
    HUNG_EXIT,
    LOST_PEER_EXIT,
    NON_FINITE_EXIT,
    PREEMPTED_EXIT,
    PREEMPTION_SIGNALS,
    RESTARTS_FILE,
    SAVE_FAILED_EXIT,
)
from disttrain.fault.stops import Preempted
from disttrain.launch.bookkeeping import keep_record
from disttrain.launch.fork_server import ForkedRank

RankProcess = subprocess.Popen | ForkedRank
"""A running worker rank: forked from the fork server, or a new interpreter where the platform has none."""

POLL_S = 0.2
CAUSE_GRACE_S = 2.0
"""How long a rank that only lost contact with the others waits for the failure that caused it to show."""
PREEMPTION_GRACE_S = 120.0
"""How long the other ranks may take to finish their checkpoint once one rank exited as preempted."""


def launch_rank(config_path: Path, fork_ranks: bool, env: dict[str, str], log_fd: int | None) -> RankProcess:
    """Start one worker rank on ``config_path`` with ``env``: forked from the fork server (``fork_ranks``) or as a
    new interpreter, writing to the job's own output (``log_fd`` None) or both its streams to ``log_fd``."""
    if fork_ranks:
        out, err = (1, 2) if log_fd is None else (log_fd, log_fd)
        return ForkedRank(config_path, env, out, err)
    command = [sys.executable, "-m", "disttrain.rank.run", str(config_path)]
    if log_fd is None:
        return subprocess.Popen(command, env=env)
    return subprocess.Popen(command, env=env, stdout=log_fd, stderr=subprocess.STDOUT)


def wait_for_an_exit(procs: Sequence[RankProcess], timeout: float) -> None:
    """Return as soon as one of ``procs`` that still run ends, or after ``timeout`` seconds: the job sees a run end
    (or a rank fail) when it happens, not up to a poll interval later. New interpreters are waited on through a
    process file descriptor where the platform has one (Linux), else for the whole ``timeout``."""
    running = [proc for proc in procs if proc.poll() is None]
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


def threads_per_rank(ranks: int) -> dict[str, str]:
    """``OMP_NUM_THREADS`` for ranks sharing this machine's cores, unless the user set it: each rank's default
    (every core) oversubscribes them, and small steps then spend their time in threads waiting on each other
    (torchrun sets 1 for the same reason)."""
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"OMP_NUM_THREADS": str(max(1, cores // ranks))}


class Supervisor:
    """Runs ``world_size`` worker ranks of one run, restarting all of them up to ``max_restarts`` times.

    ``sizes`` (largest first, from ``trainer.devices=MIN:MAX``): the world sizes the run may restart on. Each
    failure then costs the failed rank's device, presumed lost, and the next attempt starts on the largest of
    ``sizes`` that the devices left can hold; with none left the run stops.
    """

    def __init__(self, world_size: int, config_path: Path, log_dir: Path, max_restarts: int,
                 fork_ranks: bool, sizes: tuple[int, ...] = ()) -> None:
        self.world_size, self.config_path, self.log_dir = world_size, config_path, log_dir
        self.fork_ranks = fork_ranks
        self.max_restarts = max_restarts
        self.sizes = sizes
        self.devices = list(range(world_size))
        """The devices (local indices) not presumed lost; rank r of an attempt runs on ``devices[r]``."""
        self.failures: list[Failure] = []
        self._procs: list[RankProcess] = []
        self._signalled = False

    def run(self) -> int:
        """Supervise until the ranks finish; the number of restarts it took."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        (self.log_dir / RESTARTS_FILE).unlink(missing_ok=True)
        forwarded = {sig: signal.getsignal(sig) for sig in PREEMPTION_SIGNALS}
        for sig in forwarded:  # a preemption notice to the job reaches every rank, which save and stop
            signal.signal(sig, self._forward)
        try:
            for attempt in range(self.max_restarts + 1):
                failure = self._attempt(attempt)
                if failure is None:
                    return attempt
                self.failures.append(failure)
                keep_record(self.log_dir / RESTARTS_FILE, json.dumps([asdict(f) for f in self.failures], indent=2))
                if attempt == self.max_restarts or failure.code in (NON_FINITE_EXIT, SAVE_FAILED_EXIT):
                    break  # non-finite numbers, or the save that failed, would come back: a restart cannot help
                ranks = f"all {self.world_size} ranks"
                if self.sizes:
                    before = self.world_size
                    self._lose_device(failure)
                    ranks = (f"on {self.world_size} ranks instead of {before} (rank {failure.rank}'s device presumed "
                             "lost)")
                print(f"disttrain: {failure.describe()}\ndisttrain: restarting {ranks} "
                      f"({attempt + 1} of {self.max_restarts}) from the newest complete checkpoint",
                      file=sys.stderr, flush=True)
            last = self.failures[-1]
            if last.code == PREEMPTED_EXIT:  # a clean stop at a saved step, with no restart left to resume it
                raise Preempted(self._saved_step())
            restarts = len(self.failures) - 1
            after = f" after {restarts} restart(s)" if restarts else ""
            raise RanksStopped(f"{last.describe()}\nthe run stopped{after}", _exit_code(last))
        finally:
            self._kill_all()
            # a save the ranks left unfinished holds nothing usable and may hold a full disk
            for partial in (self.config_path.parent / "checkpoints").glob("*.partial"):
                shutil.rmtree(partial, ignore_errors=True)
            for sig, handler in forwarded.items():
                signal.signal(sig, handler)

    def _lose_device(self, failure: Failure) -> None:
        """Drop ``failure``'s device and size the next attempt to the devices left; RanksStopped if too few."""
        del self.devices[failure.rank]
        fits = [size for size in self.sizes if size <= len(self.devices)]
        if not fits:
            lost = self.sizes[0] - len(self.devices)
            raise RanksStopped(f"{failure.describe()}\nthe run stopped: {lost} of {self.sizes[0]} devices are presumed "
                               f"lost and the {len(self.devices)} left are fewer than the {self.sizes[-1]} ranks it "
                               "needs at least (the smallest count of trainer.devices that the layout and the global "
                               "batch allow)", _exit_code(failure))
        self.world_size = fits[0]

    def _visible_devices(self) -> dict[str, str]:
        """``CUDA_VISIBLE_DEVICES`` that leaves out the devices presumed lost (ranks take ``cuda:LOCAL_RANK``)."""
        if len(self.devices) == (self.sizes[0] if self.sizes else self.world_size):
            return {}
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible == "":  # GPUs hidden: the ranks run on the CPU and the lost devices are CPU ranks
            return {}
        names = visible.split(",") if visible else [str(index) for index in range(self.sizes[0])]
        return {"CUDA_VISIBLE_DEVICES": ",".join(names[index] for index in self.devices[:self.world_size])}

    def _attempt(self, attempt: int) -> Failure | None:
        from disttrain.parallel.store import LOOPBACK, hosted_store

        store = hosted_store(LOOPBACK, 0)  # every rank runs on this machine
        base = {"MASTER_ADDR": LOOPBACK, "MASTER_PORT": str(store.port), "WORLD_SIZE": str(self.world_size),
                "NODE_RANK": "0", "LOCAL_WORLD_SIZE": str(self.world_size), "TORCHELASTIC_USE_AGENT_STORE": "True",
                "TORCHELASTIC_RESTART_COUNT": str(attempt), "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
                **threads_per_rank(self.world_size), **self._visible_devices()}
        self._procs = [self._start(rank, {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}, attempt)
                       for rank in range(self.world_size)]
        try:
            return self._watch(attempt, store)
        finally:
            self._kill_all()
            del store

    def _start(self, rank: int, env: dict[str, str], attempt: int) -> RankProcess:
        env = {**os.environ, **env}
        if rank == 0:  # rank 0 speaks to the user directly: its output is the job's
            return self._launch(env, None)
        with open(self._log_path(rank), "a") as log:
            if attempt:
                log.write(f"--- restart {attempt} ---\n")
                log.flush()
            return self._launch(env, log.fileno())

    def _launch(self, env: dict[str, str], log_fd: int | None) -> RankProcess:
        """A worker rank writing to the job's own output, or both its streams to ``log_fd``."""
        return launch_rank(self.config_path, self.fork_ranks, env, log_fd)

    def _log_path(self, rank: int) -> Path:
        return self.log_dir / f"rank{rank}.log"

    def _watch(self, attempt: int, store: object) -> Failure | None:
        lost_since: float | None = None
        while True:
            codes = [proc.poll() for proc in self._procs]
            if all(code == 0 for code in codes):
                return None
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed and all(code == LOST_PEER_EXIT for _, code in failed) and lost_since is None:
                lost_since = time.monotonic()  # a consequence: give the rank that caused it a moment to show
            if failed and (lost_since is None or time.monotonic() - lost_since > CAUSE_GRACE_S
                           or any(code != LOST_PEER_EXIT for _, code in failed)):
                # the root cause first: a rank killed by a signal, then a diagnosed exit, then any other failure;
                # a rank that only lost contact with the others comes last
                rank, code = min(failed, key=lambda f: (f[1] >= 0, f[1] == LOST_PEER_EXIT,
                                                        f[1] not in (HUNG_EXIT, NON_FINITE_EXIT), f[0]))
                if code == PREEMPTED_EXIT:
                    return self._finish_preemption(attempt)
                return self._failure(attempt, rank, code, store)
            wait_for_an_exit(self._procs, POLL_S)

    def _finish_preemption(self, attempt: int) -> Failure | None:
        deadline = time.monotonic() + PREEMPTION_GRACE_S
        while time.monotonic() < deadline and any(proc.poll() is None for proc in self._procs):
            wait_for_an_exit(self._procs, POLL_S)
        codes = [proc.poll() for proc in self._procs]
        if all(code in (0, PREEMPTED_EXIT) for code in codes):
            if self._signalled:  # the job itself was told to go: it stops, and a requeue or a person resumes it
                raise Preempted(self._saved_step())
            # one rank was told to go (a drained node): a restart resumes from the checkpoint just written
            return Failure(attempt, codes.index(PREEMPTED_EXIT), PREEMPTED_EXIT,
                           "a preemption signal reached a rank; every rank saved a checkpoint and stopped")
        rank = next(r for r, code in enumerate(codes) if code not in (0, PREEMPTED_EXIT))
        return Failure(attempt, rank, codes[rank], "while the others stopped after a preemption signal",
                       self._tail(rank))

    def _saved_step(self) -> int | None:
        """The step of the checkpoint the ranks saved as they stopped (None if it cannot be read)."""
        from disttrain.checkpoint.io import CheckpointReadError, load_metadata

        try:
            return int(load_metadata(self.config_path.parent / "checkpoints" / "last.ckpt")["global_step"])
        except (OSError, KeyError, RuntimeError, CheckpointReadError):
            return None

    def _failure(self, attempt: int, rank: int, code: int, store: object) -> Failure:
        """The failure of ``rank``, which exited with ``code``; where a watchdog diagnosed a hang, the record
        names the rank it blamed, and ``found_by`` the rank that saw it."""
        self._kill_all()  # the others cannot go on without it (and a stopped rank only yields to SIGKILL)
        try:
            diagnosis = json.loads(store.get(FAILURE_KEY)) if store.check([FAILURE_KEY]) else None  # type: ignore
        except Exception:  # the diagnosis is a courtesy; the exit code is the fact
            diagnosis = None
        if diagnosis is None:
            return Failure(attempt, rank, code, None, self._tail(rank))
        culprit = diagnosis["rank"] if diagnosis.get("rank") is not None else rank
        return Failure(attempt, culprit, code, diagnosis["cause"], self._tail(culprit), found_by=diagnosis["found_by"],
                       exit=f"hung; rank {diagnosis['found_by']} found it (exit {code})")

    def _tail(self, rank: int, lines: int = 15) -> list[str]:
        path = self._log_path(rank)
        if rank == 0 or not path.exists():
            return []  # rank 0 wrote to the terminal, above this message
        text = path.read_text(errors="replace").split("--- restart ")[-1]
        return text.strip().splitlines()[-lines:]

    def _kill_all(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            proc.wait()

    def _forward(self, signum: int, _frame: object) -> None:
        self._signalled = True
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signum)


def _exit_code(failure: Failure) -> int:
    """The job's exit status: a hang or non-finite numbers keep their own code; other failures are 1."""
    if failure.code in (HUNG_EXIT, NON_FINITE_EXIT, PREEMPTED_EXIT, SAVE_FAILED_EXIT):
        return failure.code  # type: ignore[return-value]
    return HUNG_EXIT if (failure.cause or "").startswith("hang") else 1
