"""The restart policy of a run whose ranks cannot go on without any one of them: every rank is one group, and a
failure kills and restarts all of them from the newest complete checkpoint, on fewer ranks where
``trainer.devices=MIN:MAX`` lets the run go on without the failed rank's device."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

from disttrain.fault.config import (
    FAILURE_KEY,
    HUNG_EXIT,
    LOST_PEER_EXIT,
    NON_FINITE_EXIT,
    PREEMPTED_EXIT,
    SAVE_FAILED_EXIT,
)
from disttrain.fault.stops import Preempted
from disttrain.launch.supervisor import (
    POLL_S,
    Failure,
    RankGroup,
    RanksStopped,
    Supervisor,
    print_hang_summary,
    wait_for_an_exit,
)
from disttrain.observe.hang import REPORTS_FOLDER

CAUSE_GRACE_S = 2.0
"""How long a rank that only lost contact with the others waits for the failure that caused it to show."""
PREEMPTION_GRACE_S = 120.0
"""How long the other ranks may take to finish their checkpoint once one rank exited as preempted."""


class RestartAll(Supervisor):
    """Runs ``world_size`` worker ranks of one run, restarting all of them up to ``max_restarts`` times.

    ``sizes`` (largest first, from ``trainer.devices=MIN:MAX``): the world sizes the run may restart on. Each
    failure then costs the failed rank's device, presumed lost, and the next attempt starts on the largest of
    ``sizes`` that the devices left can hold; with none left the run stops.
    """

    def __init__(self, world_size: int, config_path: Path, log_dir: Path, max_restarts: int,
                 fork_ranks: bool, sizes: tuple[int, ...] = ()) -> None:
        super().__init__([RankGroup(0, world_size, log_dir)], config_path, log_dir, max_restarts, fork_ranks)
        self.sizes = sizes
        self.devices = list(range(world_size))
        """The devices (local indices) not presumed lost; rank r of an attempt runs on ``devices[r]``."""
        self._lost_since: float | None = None

    @property
    def world_size(self) -> int:
        """The ranks of the current attempt."""
        return self.groups[0].size

    def run(self) -> int:
        """Supervise until the ranks finish; the number of restarts it took."""
        try:
            return super().run()
        finally:  # a save the ranks left unfinished holds nothing usable and may hold a full disk
            for partial in (self.config_path.parent / "checkpoints").glob("*.partial"):
                shutil.rmtree(partial, ignore_errors=True)

    def _recover(self, group: RankGroup, failure: Failure) -> None:
        """Restart every rank, on the devices left where the run may shrink; stop the run where no restart is left
        or none can help."""
        if group.attempt == self.max_restarts or failure.code in (NON_FINITE_EXIT, SAVE_FAILED_EXIT):
            # non-finite numbers, or the save that failed, would come back: a restart cannot help
            if failure.code == PREEMPTED_EXIT:  # a clean stop at a saved step, with no restart left to resume it
                raise Preempted(self._saved_step())
            after = f" after {group.attempt} restart(s)" if group.attempt else ""
            raise RanksStopped(f"{failure.describe()}\nthe run stopped{after}", _exit_code(failure))
        ranks = f"all {self.world_size} ranks"
        if self.sizes:
            before = self.world_size
            self._lose_device(failure)
            ranks = f"on {self.world_size} ranks instead of {before} (rank {failure.rank}'s device presumed lost)"
        group.attempt += 1
        print(f"disttrain: {failure.describe()}\ndisttrain: restarting {ranks} "
              f"({group.attempt} of {self.max_restarts}) from the newest complete checkpoint",
              file=sys.stderr, flush=True)
        self._lost_since = None
        self._start(group)

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
        self.groups[0].size = fits[0]

    def _group_env(self, group: RankGroup) -> dict[str, str]:
        return self._visible_devices()

    def _visible_devices(self) -> dict[str, str]:
        """``CUDA_VISIBLE_DEVICES`` that leaves out the devices presumed lost (ranks take ``cuda:LOCAL_RANK``)."""
        if len(self.devices) == (self.sizes[0] if self.sizes else self.world_size):
            return {}
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible == "":  # GPUs hidden: the ranks run on the CPU and the lost devices are CPU ranks
            return {}
        names = visible.split(",") if visible else [str(index) for index in range(self.sizes[0])]
        return {"CUDA_VISIBLE_DEVICES": ",".join(names[index] for index in self.devices[:self.world_size])}

    def _failure(self, group: RankGroup) -> Failure | None:
        """The root cause first: a rank killed by a signal, then a diagnosed exit, then any other failure; a rank that
        only lost contact with the others comes last, and alone it is given a moment for the cause to show."""
        codes = group.codes()
        if all(code == 0 for code in codes):
            group.finished = True
            return None
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if not failed:
            return None
        if all(code == LOST_PEER_EXIT for _, code in failed):
            if self._lost_since is None:
                self._lost_since = time.monotonic()
            if time.monotonic() - self._lost_since <= CAUSE_GRACE_S:
                return None
        rank, code = min(failed, key=lambda f: (f[1] >= 0, f[1] == LOST_PEER_EXIT,
                                                f[1] not in (HUNG_EXIT, NON_FINITE_EXIT), f[0]))
        if code == PREEMPTED_EXIT:
            return self._finish_preemption(group)
        return self._diagnosed(group, rank, code)

    def _finish_preemption(self, group: RankGroup) -> Failure:
        deadline = time.monotonic() + PREEMPTION_GRACE_S
        while time.monotonic() < deadline and None in group.codes():
            wait_for_an_exit(group.procs, POLL_S)
        codes = group.codes()
        if all(code in (0, PREEMPTED_EXIT) for code in codes):
            if self._signalled:  # the job itself was told to go: it stops, and a requeue or a person resumes it
                raise Preempted(self._saved_step())
            # one rank was told to go (a drained node): a restart resumes from the checkpoint just written
            return Failure(group.attempt, codes.index(PREEMPTED_EXIT), PREEMPTED_EXIT,
                           "a preemption signal reached a rank; every rank saved a checkpoint and stopped")
        rank = next(r for r, code in enumerate(codes) if code not in (0, PREEMPTED_EXIT))
        return Failure(group.attempt, rank, codes[rank], "while the others stopped after a preemption signal",
                       group.tail(rank))

    def _saved_step(self) -> int | None:
        """The step of the checkpoint the ranks saved as they stopped (None if it cannot be read)."""
        from disttrain.checkpoint.io import CheckpointReadError, load_metadata

        try:
            return int(load_metadata(self.config_path.parent / "checkpoints" / "last.ckpt")["global_step"])
        except (OSError, KeyError, RuntimeError, CheckpointReadError):
            return None

    def _diagnosed(self, group: RankGroup, rank: int, code: int) -> Failure:
        """The failure of ``rank``, which exited with ``code``; where a watchdog diagnosed a hang, the record
        names the rank it blamed, and ``found_by`` the rank that saw it."""
        group.kill()  # the others cannot go on without it (and a stopped rank only yields to SIGKILL)
        try:
            diagnosis = json.loads(group.store.get(FAILURE_KEY)) if group.store.check([FAILURE_KEY]) else None
        except Exception:  # the diagnosis is a courtesy; the exit code is the fact
            diagnosis = None
        if diagnosis is None:
            return Failure(group.attempt, rank, code, None, group.tail(rank))
        if str(diagnosis.get("cause", "")).startswith("hang"):
            print_hang_summary(self.log_dir / REPORTS_FOLDER, group.size)
        culprit = diagnosis["rank"] if diagnosis.get("rank") is not None else rank
        found_by = diagnosis["found_by"]
        return Failure(group.attempt, culprit, code, diagnosis["cause"], group.tail(culprit), found_by=found_by,
                       exit=f"hung; rank {found_by} found it (exit {code})")


def _exit_code(failure: Failure) -> int:
    """The job's exit status: a hang or non-finite numbers keep their own code; other failures are 1."""
    if failure.code in (HUNG_EXIT, NON_FINITE_EXIT, PREEMPTED_EXIT, SAVE_FAILED_EXIT):
        return failure.code  # type: ignore[return-value]
    return HUNG_EXIT if (failure.cause or "").startswith("hang") else 1
