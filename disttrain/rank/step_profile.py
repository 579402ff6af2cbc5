"""A window of training steps under ``torch.profiler``: where a step's time goes, on the host and the device.

Added with ``callbacks=profile``. Each rank writes ``profile/rank<R>_ops.txt`` (the operators and kernels,
slowest first), ``profile/rank<R>_trace.json`` (a timeline for chrome://tracing or Perfetto), on a GPU
``profile/rank<R>_host_reads.txt`` (each line of Python that made the host wait for the GPU, with its stack) and
``profile/rank<R>_host_ops.txt`` (the operators by host time), and with ``with_stack``
``profile/rank<R>_host_stacks.txt`` (the operators by the Python lines that ran them, by host time) under the run
folder, and rank 0 says in one line how long a profiled step took and how much of it the device was busy: a
device idle between steps waits on the host (data, Python, a host read).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.autograd import DeviceType
from torch.autograd.profiler_util import EventList
from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile

from disttrain.rank.host_reads import HostReads

STACK_FRAMES = 6
"""Python frames that key an operator's row in the stacks table (``with_stack``)."""


class StepProfiler(pl.Callback):
    """Profile optimiser steps ``start_step + 1`` to ``start_step + steps`` of a fit (after compilation and the
    allocator's warm-up, which the first steps pay)."""

    def __init__(self, start_step: int = 10, steps: int = 5, dirpath: str | None = None, row_limit: int = 40,
                 with_stack: bool = False) -> None:
        if start_step < 0 or steps < 1:
            raise ValueError(f"StepProfiler: start_step={start_step} and steps={steps}: start_step >= 0 and "
                             "steps >= 1 are allowed")
        self.start_step = start_step
        """Optimiser steps done before the window opens."""
        self.steps = steps
        """Optimiser steps profiled."""
        self.dirpath = dirpath
        """Where the files go; None: ``profile/`` in the run folder."""
        self.row_limit = row_limit
        """Rows of the operator table."""
        self.with_stack = with_stack
        """Record the Python stack of every operator in the timeline (which line read a value back to the host,
        say), and write ``rank<R>_host_stacks.txt``: the operators by the Python lines that ran them, by host
        time; the profiled steps run slower still."""
        self._profiler: profile | None = None
        self._host_reads = HostReads()
        self._started_at = 0.0
        self.summary: dict[str, float] | None = None
        """After the window: ``step_ms`` (wall clock per step), ``device_ms`` (device kernel time per step, where
        a device was profiled), ``host_reads`` (synchronising CUDA calls per step, on a GPU) and ``steps``."""

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """Open the window at its first step's first micro-batch."""
        if self._profiler is not None or self.summary is not None or trainer.global_step != self.start_step:
            return
        self._device = pl_module.device
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self._device.type == "cuda" else [])
        self._synchronize()
        # verbose: without it torch records stacks for the timeline only, not on the events the tables group by
        verbose = {"experimental_config": _ExperimentalConfig(verbose=True)} if self.with_stack else {}
        self._profiler = profile(activities=activities, with_stack=self.with_stack, **verbose)
        self._profiler.start()
        self._host_reads.start(cuda=self._device.type == "cuda")
        self._started_at = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Close the window once its steps are done; also at a fit that ends inside it."""
        if self._profiler is not None and trainer.global_step >= self.start_step + self.steps:
            self._close(trainer, trainer.global_step - self.start_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A fit shorter than the window still writes what was profiled."""
        if self._profiler is not None:
            self._close(trainer, trainer.global_step - self.start_step)

    def _synchronize(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def _close(self, trainer: pl.Trainer, steps: int) -> None:
        self._synchronize()
        wall_s = time.perf_counter() - self._started_at
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        self._host_reads.stop()
        folder = Path(self.dirpath or Path(trainer.default_root_dir) / "profile")
        folder.mkdir(parents=True, exist_ok=True)
        rank = trainer.global_rank
        averages = profiler.key_averages()
        on_device = self._device.type != "cpu"
        sort_by = "self_device_time_total" if on_device else "self_cpu_time_total"
        (folder / f"rank{rank}_ops.txt").write_text(averages.table(sort_by=sort_by, row_limit=self.row_limit))
        if on_device:  # a host-bound step shows in the host's own time, which the device-sorted table hides
            (folder / f"rank{rank}_host_ops.txt").write_text(
                averages.table(sort_by="self_cpu_time_total", row_limit=self.row_limit))
        if self.with_stack:  # the Python lines whose operators took the host's time
            (folder / f"rank{rank}_host_stacks.txt").write_text(
                operators_by_stack(profiler.events(), self.row_limit, self._device.type if on_device else None))
        profiler.export_chrome_trace(str(folder / f"rank{rank}_trace.json"))
        steps = max(steps, 1)
        self.summary = {"steps": steps, "step_ms": 1e3 * wall_s / steps}
        window = f"{self.start_step + 1}-{self.start_step + steps}"
        line = f"profile of steps {window}: {self.summary['step_ms']:.2f} ms a step"
        if on_device:
            self.summary["device_ms"] = busy_us(profiler.events()) / 1e3 / steps
            line += (f", the device busy {self.summary['device_ms']:.2f} ms of it "
                     f"({100 * self.summary['device_ms'] / self.summary['step_ms']:.0f}%)")
            self.summary["host_reads"] = self._host_reads.total / steps
            (folder / f"rank{rank}_host_reads.txt").write_text(self._host_reads.table(steps))
            line += f", {self.summary['host_reads']:.1f} host reads a step"
        if rank == 0:
            print(f"{line}; operators and timeline in {folder}", flush=True)


def operators_by_stack(events: EventList, row_limit: int, device: str | None) -> str:
    """The operators and annotated ranges by the innermost ``STACK_FRAMES`` Python frames that ran them, most host
    time first; the Python functions the verbose tracer also records (every thread's) are left out as rows.
    ``device``: the profiled device's type, for its time columns (None: the host only)."""
    python_functions = {event.key for event in events if event.is_python_function}
    rows = [row for row in events.key_averages(group_by_stack_n=STACK_FRAMES) if row.key not in python_functions]
    return EventList(rows, use_device=device).table(sort_by="cpu_time_total", row_limit=row_limit)


def busy_us(events: list[Any]) -> float:
    """Microseconds in which the device ran a kernel, a copy or a fill: the union of their spans, so that
    streams running side by side (a collective beside compute) count once."""
    spans = sorted((event.time_range.start, event.time_range.end) for event in events
                   if event.device_type != DeviceType.CPU and not event.is_user_annotation)
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    return busy
