"""Hang detection: ranks publish heartbeats and progress in the rendezvous store and watch each other's.

A rank that is stopped (SIGSTOP), frozen or gone stops beating; a deadlock leaves beats going but stops
progress on every rank. Either is seen by the other ranks' watchdog threads within ``timeout_s``: they
name the stuck rank, leave the diagnosis in the store for the supervisor, and exit with ``HUNG_EXIT``, so
the launcher (disttrain's or torchrun's) restarts or ends the job instead of waiting for the collective
timeout. The counters are compared by each watcher's own clock, so clocks of different nodes never mix.
torch.distributed.elastic.timer's ``FileTimerServer`` was the first candidate, but it kills its own
process (the launcher) after reaping a worker, and it sees one node only.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

from disttrain.fault.config import FAILURE_KEY, HUNG_EXIT
from disttrain.observe.hang import DUMP_KEY, write_report

REPORT_WAIT_BEATS = 3
"""Beats a rank that found a hang waits for the other ranks' reports before it exits (each rank looks for a
request once a beat)."""


class RankWatchdog(pl.Callback):
    """Publishes this rank's heartbeat and progress; exits the process when another rank is stuck."""

    def __init__(self, timeout_s: float, reports: Path | None = None) -> None:
        self.timeout_s = timeout_s
        self.reports = reports
        """Where this rank writes its stacks and last collective when a hang is found or the job asks
        (``disttrain.observe.hang``); None: nowhere."""
        self._answered = ""  # the newest report request this rank answered
        self.interval_s = min(2.0, max(0.2, timeout_s / 10))
        self._progress = 0
        self._step = 0
        self._done = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- progress marks, from the training loop (main thread): a counter bump, no I/O ----
    def mark(self, step: int | None = None) -> None:
        """The main thread made progress (a batch, an evaluation batch, a checkpoint)."""
        self._progress += 1
        if step is not None:
            self._step = step

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start watching once every rank has joined the process group."""
        self.start(trainer.global_rank, trainer.world_size)

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        self.mark(trainer.global_step)

    def on_validation_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        self.mark()

    def on_test_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        self.mark()

    def on_save_checkpoint(self, trainer: pl.Trainer, *_: Any) -> None:
        self.mark()

    # ---- the watching thread ----
    def start(self, rank: int, world_size: int) -> None:
        """Start the heartbeat thread (once; a no-op for one rank or ``timeout_s=0``)."""
        if self._thread is not None or world_size < 2 or self.timeout_s <= 0:
            return
        self.rank, self.world_size = rank, world_size
        prefix = f"disttrain/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/beat/"
        self._keys = [f"{prefix}{r}" for r in range(world_size)]
        self._thread = threading.Thread(target=self._run, name="disttrain-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Tell the others this rank is done (its silence is no hang) and stop the thread."""
        self._done = True
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        from torch.distributed import TCPStore

        address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        try:
            store = TCPStore(address, port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=max(1.0, self.timeout_s)))
        except Exception as err:  # noqa: BLE001 - an unreachable store is itself the diagnosis
            self._fail(f"hang: the rendezvous store at {address}:{port} did not answer ({err})", None, None)
            return
        beat = 0
        started = time.monotonic()
        seen: dict[int, tuple[str, str, float]] = {}  # rank -> (beat, progress, when either last changed)
        progress_changed = started
        while True:
            beat += 1
            done = self._done
            asked = time.monotonic()
            try:
                store.set(self._keys[self.rank], f"{beat} {self._progress} {self._step} {int(done)}")
                if done:
                    return
                present = [key for key in (*self._keys, DUMP_KEY) if store.check([key])]
                values = dict(zip(present, store.multi_get(present), strict=True)) if present else {}
                self._answer(values.get(DUMP_KEY, b"").decode(), "asked by the job")
            except Exception as err:  # noqa: BLE001
                waited = time.monotonic() - asked
                # torch's error carries C++ frames after its first line
                why = (str(err).strip().splitlines() or [type(err).__name__])[0]
                self._fail(f"hang: the rendezvous store at {address}:{port} " + (
                    f"did not answer within {self.timeout_s:g} s ({why})" if waited >= self.timeout_s
                    else f"closed the connection after {waited:.1f} s: its job is gone ({why})"), store, None)
                return
            now = time.monotonic()
            steps = {}
            for rank, key in enumerate(self._keys):
                if key not in values:
                    if now - started > self.timeout_s:
                        self._fail(f"hang: rank {rank} never reported within {self.timeout_s:g} s", store, rank)
                        return
                    continue
                other_beat, progress, step, finished = values[key].decode().split()
                steps[rank] = int(step)
                if finished == "1":
                    continue
                old = seen.get(rank)
                if old is None or old[0] != other_beat:
                    if old is not None and old[1] != progress:
                        progress_changed = now
                    seen[rank] = (other_beat, progress, now)
                elif now - old[2] > self.timeout_s:
                    self._fail(f"hang: rank {rank} has not answered for {now - old[2]:.0f} s (stopped, frozen "
                               f"or unreachable), last seen at step {step}", store, rank)
                    return
            if now - max(progress_changed, started) > self.timeout_s:
                slowest = min(steps, key=lambda r: (steps[r], r)) if steps else self.rank
                self._fail(f"hang: no rank made progress for {now - progress_changed:.0f} s (a deadlock?); "
                           f"steps by rank {steps}, slowest rank {slowest}", store, slowest)
                return
            if self._stop.wait(self.interval_s):
                self._done = True  # publish "done" once more, then leave

    def _fail(self, message: str, store: Any, culprit: int | None) -> None:
        """Leave the diagnosis (and the rank it blames, None where none is known) for the supervisor, say it,
        and exit with ``HUNG_EXIT``."""
        if store is not None:
            try:  # the first diagnosis wins
                store.compare_set(FAILURE_KEY, "", json.dumps({"cause": message, "rank": culprit,
                                                               "found_by": self.rank}))
            except Exception:  # noqa: BLE001 - the exit code below is what the launcher acts on
                pass
        print(f"disttrain: rank {self.rank}: {message}", file=sys.stderr, flush=True)
        if store is not None and self.reports is not None:
            self._reports_before_exit(store, message)
        os._exit(HUNG_EXIT)

    def _answer(self, request: str, reason: str) -> None:
        """Write this rank's report once per request (an empty request: none made)."""
        if request and request != self._answered and self.reports is not None:
            self._answered = request
            try:
                write_report(self.reports, self.rank, reason)
            except OSError as err:  # a report is a courtesy; the watching goes on
                print(f"disttrain: rank {self.rank}: no hang report written ({err})", file=sys.stderr, flush=True)

    def _reports_before_exit(self, store: Any, message: str) -> None:
        """Ask every rank for its report, write this one's, and give the others a few beats to write theirs: the
        job stops every rank as soon as this one exits."""
        try:
            store.compare_set(DUMP_KEY, "", f"hang {self.rank}")
            request = store.get(DUMP_KEY).decode()
        except Exception:  # noqa: BLE001 - the store is gone: this rank's report is all there is
            request = f"hang {self.rank}"
        self._answer(request, message)
        deadline = time.monotonic() + REPORT_WAIT_BEATS * self.interval_s
        while time.monotonic() < deadline and len(list(self.reports.glob("rank*.json"))) < self.world_size:
            time.sleep(self.interval_s / 4)
