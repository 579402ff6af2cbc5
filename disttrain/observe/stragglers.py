"""Straggler detection: each rank times its step's phases at Lightning's hooks (under a pipeline, at its stages'
actions: ``disttrain.observe.phases``); every logging window the ranks exchange the window's means, fastest steps
and spreads, and rank 0 names a rank slower than the median rank in every step of several windows in a row.

The exchange is one all-gather of a few numbers per rank, made at the end of a step that logs. Every step already
synchronises the ranks there: the step's loss is all-reduced (``StepAgreement.reduce_loss``) and its gradients
are exchanged, so the ranks arrive at the gather within one optimiser step of each other and it waits for
nobody; the steps in between exchange nothing.

In lockstep, one slow rank makes the others wait at the next collective, so their phase holding it looks slow
too. The rank named is the one slow in the earliest phase of the step: the others are slow only later, waiting
for it.
"""

from __future__ import annotations

import json
import math
import socket
import statistics
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from disttrain.observe.collectives import RECORDER
from disttrain.observe.phases import PHASE_MARKS
from disttrain.records import keep_record

PHASES = ("data", "forward", "backward", "collectives", "optimiser")
"""A step's phases in the order they run: ``data`` from the end of the previous step to the start of this one
(the loader's fetch and the loop between steps), ``forward`` to the loss, ``backward`` to the gradients,
``optimiser`` to the end of the step (clipping, the update, the schedule); ``collectives``: the time in any of
them blocked in a recorded collective (``disttrain.observe.collectives``), and under DDP from the rank's last
gradient to the end of its backward (the exchange DDP makes from C++, waiting for the other ranks). Under a pipeline
the schedule runs forward and backward inside the step: its stages mark them (``disttrain.observe.phases``), their
loss counts as forward, and its time between them (sending to and waiting for the neighbouring stages) as
``collectives``."""
COLLECTIVES = PHASES.index("collectives")
WAITING = ("collectives",)
"""Phases in which a rank waits for the others: never the phase a straggler is named for."""
COLUMNS = (*PHASES, "step")
"""What each rank reports per window: its mean milliseconds per step in each phase, and in its whole step."""
JUDGED = (*(name for name in PHASES if name not in WAITING), "step")
"""What a rank is judged on: each phase it does not wait in, and ``step``, its step without its waits (in lockstep
every rank's whole step is the same length, the slow one's busier)."""
_JUDGED_PHASES = [PHASES.index(name) for name in JUDGED[:-1]]  # the phases among them, by their index in PHASES
MIN_SHARE = 0.1
"""A phase is slow only when it also exceeds the median rank's by this share of the median rank's step: a short
phase (the optimiser of a tiny model) differs by large factors from timer and scheduler noise alone, and costs the
step little."""
STRAGGLERS_FILE = "stragglers.jsonl"
"""In the run's ``logs/`` folder: one JSON line per named straggler."""


def slow_ranks(fastest: list[list[float]], spreads: list[list[float]], step_ms: float,
               ratio: float) -> dict[int, tuple[str, float]]:
    """The ranks slow in a window, each with the phase (or "step") and its factor over the median rank; of those,
    only the ranks whose first slow phase is the earliest one (a rank slow only later in the step waits for them).

    ``fastest``: one row per rank, ``JUDGED`` in order: the milliseconds of its fastest step of the window in each;
    ``spreads``: its slowest step's minus its fastest's; ``step_ms``: the median rank's mean step. A rank is slow in
    a column when its fastest step there exceeds the median rank's fastest by more than ``ratio``, by more than
    ``MIN_SHARE`` of ``step_ms``, and by more than its own spread over the window.

    Noise only ever adds time: a rank delayed now and then by the machine (another process, the scheduler) keeps
    a fast step in the window, and one delayed in every step by varying amounts varies by more than it exceeds the
    others. A rank is named only when it was slower in every step of the window, by more than it varied: so a
    run whose ranks have the same work names none, at any ratio, unless one rank is held back steadily."""
    found: dict[int, tuple[int, float]] = {}
    floor = MIN_SHARE * step_ms
    for column in range(len(JUDGED)):
        median = statistics.median(row[column] for row in fastest)
        for rank, row in enumerate(fastest):
            excess = row[column] - median
            if rank not in found and excess > max(floor, spreads[rank][column]) and row[column] > ratio * median:
                found[rank] = (column, row[column] / median if median > 0 else float("inf"))
    if not found:
        return {}
    earliest = min(column for column, _ in found.values())
    return {rank: (JUDGED[column], factor) for rank, (column, factor) in found.items() if column == earliest}


class StragglerDetector(pl.Callback):
    """Times this rank's phases per step; at each logging step joins the all-gather of the window's means and,
    on rank 0, names a rank that was slow ``windows`` windows in a row (console, ``logs/stragglers.jsonl``)."""

    def __init__(self, ratio: float, windows: int, every: int, log_dir: Path) -> None:
        self.ratio = ratio
        """A rank slower than the median rank by this factor, in a phase or its step, is slow in that window."""
        self.windows = windows
        """Windows in a row a rank is slow in before it is named."""
        self.every = max(1, every)
        """Optimiser steps per window (``trainer.log_every_n_steps``)."""
        self.log_dir = log_dir
        """Where rank 0 writes ``stragglers.jsonl``."""
        self.named: list[dict[str, Any]] = []
        """The stragglers named so far (rank 0), as written to ``stragglers.jsonl``."""
        self.hosts: list[str] = []
        """Every rank's host name."""
        self.active = False
        """Whether this fit has ranks to compare (more than one)."""
        self._step = [0.0] * len(PHASES)  # seconds per phase in this step
        self._window: list[float] = []  # seconds per phase in this window's steps
        self._fastest: list[float] = []  # seconds of this window's fastest step in each judged column
        self._slowest: list[float] = []  # and of its slowest
        self._window_steps = 0
        self._start_window()
        self._totals: torch.Tensor | None = None  # per rank and column: summed window means (rank 0)
        self._windows_seen = 0
        self._streaks: dict[int, tuple[int, int, str, float]] = {}  # rank -> (windows, since step, phase, factor)
        self._last = 0.0
        self._gradient_at = 0.0  # when this rank's backward last accumulated a gradient
        self._blocked = 0.0  # the recorder's blocked seconds at the last mark
        self._step_at_end = 0
        self._timing = False

    # ---- the phase clock: one clock read per hook ----
    def _mark(self, phase: int, now: float | None = None) -> None:
        """Close ``phase`` at ``now`` (default: the clock now); its time blocked in recorded collectives goes to
        the ``collectives`` phase."""
        now = time.perf_counter() if now is None else now
        blocked = RECORDER.blocked_s - self._blocked
        self._step[phase] += now - self._last - blocked
        self._step[COLLECTIVES] += blocked
        self._last, self._blocked = now, RECORDER.blocked_s

    def _end_step(self) -> None:
        """Add the step's phases to the window's sums, fastest and slowest steps (plain loops: once per step)."""
        step, window, fastest, slowest = self._step, self._window, self._fastest, self._slowest
        busy = 0.0
        for column, phase in enumerate(_JUDGED_PHASES):
            seconds = step[phase]
            busy += seconds
            if seconds < fastest[column]:
                fastest[column] = seconds
            if seconds > slowest[column]:
                slowest[column] = seconds
        if busy < fastest[-1]:  # the step without its waits
            fastest[-1] = busy
        if busy > slowest[-1]:
            slowest[-1] = busy
        for phase, seconds in enumerate(step):
            window[phase] += seconds
        self._step = [0.0] * len(PHASES)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Learn every rank's host (one gather, before the first step); one rank has nobody to compare with."""
        self.active = trainer.world_size > 1
        if not self.active:
            return
        self.hosts = [socket.gethostname()] * trainer.world_size
        dist.all_gather_object(self.hosts, socket.gethostname())
        for param in pl_module.parameters():  # DDP's (and a plain module's): the same leaves autograd fills
            if param.requires_grad and not isinstance(param, DTensor):
                param.register_post_accumulate_grad_hook(self._gradient_accumulated)
        self._step_at_end = trainer.global_step
        PHASE_MARKS.listener = self._phase_ended  # a pipeline's schedule marks its stages' phases

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Nothing marks phases for this detector any more."""
        PHASE_MARKS.listener = None

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """As ``on_train_end``, also where training stopped on an error."""
        PHASE_MARKS.listener = None

    def _phase_ended(self, phase: str) -> None:
        self._mark(PHASES.index(phase))

    def _gradient_accumulated(self, _param: torch.Tensor) -> None:
        self._gradient_at = time.perf_counter()

    def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        """The batch is fetched: the data phase ends (timing starts after the first, warm-up step)."""
        if not self.active:
            return
        if self._timing:
            self._mark(0)
        else:
            self._last, self._blocked = time.perf_counter(), RECORDER.blocked_s

    def on_before_backward(self, *_: Any) -> None:
        """The loss exists."""
        if not self.active:
            return
        self._mark(1)

    def on_after_backward(self, *_: Any) -> None:
        """The gradients exist: this rank's own backward ended at its last gradient, the rest was waiting."""
        if not self.active:
            return
        if self._gradient_at > self._last:  # DDP's exchange is made from C++, unrecorded: the wait after it
            self._mark(2, self._gradient_at)
            self._mark(COLLECTIVES)
        else:  # no gradient hook fired (FSDP2 fills its sharded gradients itself, in recorded collectives)
            self._mark(2)

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        """The step is taken; at the end of a window, the exchange."""
        if not self.active:
            return
        self._mark(4)
        stepped, self._step_at_end = trainer.global_step != self._step_at_end, trainer.global_step
        if not stepped:  # a micro-batch that only accumulated: the step goes on
            return
        if not self._timing:  # the first step pays for warm-up on every rank: not a window's
            self._timing = True
            self._step = [0.0] * len(PHASES)
            return
        self._end_step()
        self._window_steps += 1
        if trainer.global_step % self.every == 0:
            self._exchange(trainer)

    def _window_row(self) -> list[float]:
        """What this rank sends for the window, in milliseconds: its mean step per phase (``COLUMNS``), then its
        fastest step in each ``JUDGED`` column, then its slowest's excess over its fastest there (the spread)."""
        steps = max(self._window_steps, 1)
        means = [1e3 * seconds / steps for seconds in self._window]
        fastest = [1e3 * seconds for seconds in self._fastest]
        spreads = [1e3 * (slow - fast) for slow, fast in zip(self._slowest, self._fastest, strict=True)]
        return [*means, sum(means), *fastest, *spreads]

    def _start_window(self) -> None:
        self._window, self._window_steps = [0.0] * len(PHASES), 0
        self._fastest, self._slowest = [math.inf] * len(JUDGED), [0.0] * len(JUDGED)

    def _exchange(self, trainer: pl.Trainer) -> None:
        local = torch.tensor(self._window_row(), dtype=torch.float64, device=trainer.strategy.root_device)
        gathered = torch.empty(trainer.world_size * local.numel(), dtype=local.dtype, device=local.device)
        dist.all_gather_single(gathered, local)  # gloo gathers into a flat tensor only
        first_step = trainer.global_step - self._window_steps + 1
        self._start_window()
        if trainer.global_rank == 0:
            self._judge_window(gathered.cpu().view(trainer.world_size, -1), first_step, trainer.global_step)
        self._last, self._blocked = time.perf_counter(), RECORDER.blocked_s  # the exchange belongs to no phase

    def _judge_window(self, table: torch.Tensor, first_step: int, step: int) -> None:
        """Judge one window's table (one row per rank: ``COLUMNS``' means, ``JUDGED``'s fastest steps and their
        spreads); its means add to the run's."""
        means, fastest, spreads = table.split([len(COLUMNS), len(JUDGED), len(JUDGED)], dim=1)
        self._totals = means if self._totals is None else self._totals + means
        self._windows_seen += 1
        self._judge(means.tolist(), fastest.tolist(), spreads.tolist(), first_step, step)

    def _judge(self, means: list[list[float]], fastest: list[list[float]], spreads: list[list[float]],
               first_step: int, step: int) -> None:
        slow = slow_ranks(fastest, spreads, statistics.median(row[-1] for row in means), self.ratio)
        for rank in list(self._streaks):
            if rank not in slow:
                del self._streaks[rank]
        for rank, (phase, factor) in slow.items():
            windows, since, *_ = self._streaks.get(rank, (0, first_step, phase, factor))
            self._streaks[rank] = (windows + 1, since, phase, factor)
            if windows + 1 == self.windows:
                self._name(rank, phase, since, step, means)

    def _name(self, rank: int, phase: str, since: int, step: int, means: list[list[float]]) -> None:
        """Name ``rank``, slow in ``phase`` since step ``since``: the line, ``stragglers.jsonl`` and ``named`` give
        the window's mean milliseconds a step (``means``: one row per rank, ``COLUMNS`` in order)."""
        column = COLUMNS.index(phase)
        busy = [row[column] - sum(row[COLUMNS.index(name)] for name in WAITING) * (phase == "step") for row in means]
        median = statistics.median(busy)
        factor = busy[rank] / median if median > 0 else float("inf")
        entry = {"rank": rank, "host": self.hosts[rank] if rank < len(self.hosts) else "?", "phase": phase,
                 "slower": round(factor, 3), "ms": round(busy[rank], 3), "median_ms": round(median, 3),
                 "since_step": since, "named_at_step": step}
        self.named.append(entry)
        print(f"disttrain: straggler: rank {rank} ({entry['host']}) is {factor:.2f}x slower than the median rank "
              f"in {phase} ({entry['ms']:.1f} ms vs {median:.1f} ms a step) since step {since}", flush=True)
        try:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass  # keep_record names the file it could not write
        keep_record(self.log_dir / STRAGGLERS_FILE, json.dumps(entry) + "\n", append=True)

    def result(self) -> dict[str, Any]:
        """``results.json``'s ``stragglers``: the named ones, and per rank its mean step and slowest phase over
        the windows exchanged (rank 0; empty before the first window)."""
        ranks = []
        if self._totals is not None:
            for rank, row in enumerate((self._totals / self._windows_seen).tolist()):
                slowest = max((c for c, name in enumerate(PHASES) if name not in WAITING), key=lambda c: row[c])
                ranks.append({"rank": rank, "host": self.hosts[rank] if rank < len(self.hosts) else "?",
                              "step_ms": round(row[-1], 3), "slowest_phase": PHASES[slowest],
                              "slowest_phase_ms": round(row[slowest], 3),
                              "phases_ms": {name: round(row[i], 3) for i, name in enumerate(PHASES)}})
        return {"ratio": self.ratio, "windows": self.windows, "named": self.named, "ranks": ranks}
