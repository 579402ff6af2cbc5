"""``callbacks=memory``: one optimiser step's memory, allocation by allocation, beside the plan's prediction.

Every rank records the same step (each holds its own shards and stages, and recording only one would slow it
alone, a straggler by construction): on a CPU through the framework's tensor-byte counter
(``disttrain.observe.counted_step``), on a GPU through torch's CUDA memory history (``disttrain.observe.cuda_step``,
untested). Rank 0 writes ``logs/memory_step.json`` (the timeline, the peak, the largest tensors alive at the peak
with their shape, dtype, module and phase, the measured moments beside the plan's) and ``plots/memory_step.png``,
and prints one line; rank R > 0 writes ``logs/memory_step_rank<R>.json``. The step's peak goes into results.json
(``memory.recorded_step``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils._pytree import tree_leaves

from disttrain.observe.counted_step import CountedStep
from disttrain.observe.cuda_step import CudaStep
from disttrain.observe.memory_options import MemoryStepOptions
from disttrain.report.memory_plot import write_memory_plot

RECORD_FILE = "memory_step.json"
"""Rank 0's record, in ``logs/``."""
PICTURE_FILE = "memory_step.png"
"""Rank 0's picture, in ``plots/``."""


class StepMemoryCallback(pl.Callback):
    """Record optimiser step ``step + 1`` (all its micro-batches, backward and the optimiser's step) on every
    rank; see the module."""

    def __init__(self, step: int = 2, dirpath: str | None = None, largest: int = 10) -> None:
        self.options = MemoryStepOptions(step, dirpath, largest)
        """What to record and where (checked before ranks start, and again here for a callback built in code)."""
        self.options.check("callbacks.memory")
        self.planned: Callable[[], dict[str, float] | None] | None = None
        """The plan's bytes at its moments on its most loaded rank (rank 0's), asked for by rank 0 once the step
        is recorded; handed over by the rank's assembly (None: no plan is drawn)."""
        self.draw = True
        """Whether rank 0 draws the picture (the run's ``plots``, handed over with the plan)."""
        self.result: dict[str, Any] | None = None
        """After the step: ``step``, ``peak_bytes`` (the counter's or the allocator's own peak) and
        ``counted_by``, for results.json."""
        self.line: str | None = None
        """Rank 0's line about the step, once written."""
        self._recording: CountedStep | CudaStep | None = None
        self._first_step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Note where this fit starts (after a resume, past step 0)."""
        self._first_step = trainer.global_step

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        """Begin at the recorded step's first micro-batch; each later one enters its forward."""
        if self._recording is not None:
            self._recording.stage("forward")
            return
        if self.result is not None or trainer.global_step != self.options.step:
            return
        rank, device = trainer.global_rank, pl_module.device
        if device.type == "cuda":
            self._recording = CudaStep(self.options.step, rank, device)
            self._recording.start()
        else:
            self._recording = CountedStep(self.options.step, rank)
            self._recording.start(known_tensors(pl_module, trainer.optimizers, batch))

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        """Forward and the loss are done (the last micro-batch's mark stays)."""
        if self._recording is not None:
            self._recording.mark("after_forward")
            self._recording.stage("backward")

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Backward is done (the last micro-batch's mark stays)."""
        if self._recording is not None:
            self._recording.mark("after_backward")

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: torch.optim.Optimizer) -> None:
        """Clipping and the optimiser's step follow."""
        if self._recording is not None:
            self._recording.stage("optimiser")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """End once the optimiser has stepped."""
        if self._recording is not None and trainer.global_step > self.options.step:
            self._finish(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A fit that ended inside the step writes what ran; one that never reached it says so."""
        if self._recording is not None:
            self._finish(trainer)
        elif self.result is None and trainer.is_global_zero:
            print(f"memory: step {self.options.step + 1} is not among this fit's steps ({self._first_step + 1} to "
                  f"{trainer.global_step}): nothing recorded", flush=True)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """A fit that failed inside the step stops recording (the counter leaves the operators) and writes nothing."""
        if self._recording is not None:
            recording, self._recording = self._recording, None
            recording.stop()

    def _finish(self, trainer: pl.Trainer) -> None:
        recording, self._recording = self._recording, None
        recording.mark("after_step")
        timeline = recording.stop()
        self.result = {"step": self.options.step, "peak_bytes": recording.peak, "counted_by": timeline.counted_by}
        planned = self.planned() if self.planned is not None and timeline.rank == 0 else None
        record = timeline.as_json(self.options.largest, planned)
        run_dir = Path(trainer.default_root_dir)
        logs = Path(self.options.dirpath) if self.options.dirpath else run_dir / "logs"
        plots = Path(self.options.dirpath) if self.options.dirpath else run_dir / "plots"
        logs.mkdir(parents=True, exist_ok=True)
        name = RECORD_FILE if timeline.rank == 0 else f"memory_step_rank{timeline.rank}.json"
        (logs / name).write_text(json.dumps(record) + "\n")
        if timeline.rank != 0:
            return
        picture = write_memory_plot(record, plots / PICTURE_FILE) if self.draw else None
        self.line = summary_line(record, [logs / name, *([picture] if picture else [])])
        print(self.line, flush=True)


def known_tensors(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                  batch: Any) -> list[tuple[str, str, torch.Tensor]]:
    """``(what, name, tensor)`` of what a step begins with: parameters, their gradients, buffers, the optimisers'
    state (named by its parameter) and the batch."""
    names = {id(param): name for name, param in module.named_parameters()}
    known = [("parameter", name, param) for name, param in module.named_parameters()]
    known += [("gradient", name, param.grad) for name, param in module.named_parameters() if param.grad is not None]
    known += [("buffer", name, buffer) for name, buffer in module.named_buffers()]
    for optimizer in optimizers:
        for param, state in optimizer.state.items():
            known += [("optimiser state", f"{names.get(id(param), '?')}.{key}", value) for key, value in state.items()
                      if isinstance(value, torch.Tensor)]
    known += [("batch", "", leaf) for leaf in tree_leaves(batch) if isinstance(leaf, torch.Tensor)]
    return known


def summary_line(record: dict[str, Any], paths: list[Path]) -> str:
    """The one line rank 0 prints: the peak, when it happened and what held most of it, and the plan's peak."""
    mb = 1e6
    where = f"after {record['peak_after_events']} of {record['events']} allocations and releases, in " \
            f"{record['peak_phase']}"
    line = f"memory of step {record['step'] + 1} on rank 0: peak {record['peak_bytes'] / mb:.4g} MB {where}"
    if record["largest_at_peak"]:
        top = record["largest_at_peak"][0]
        shape = "x".join(map(str, top["shape"])) or "?"
        origin = " ".join(part for part in (top["made_by"], f"in {top['module']}" if top["module"] else "",
                                            f"({top['phase']})") if part)
        line += f"; largest holder {top['bytes_at_peak'] / mb:.4g} MB {top['dtype']} [{shape}] {origin}"
    planned = record.get("planned_moments_bytes")
    if planned:
        moment = max(planned, key=planned.get)
        line += f"; plan: peak {planned[moment] / mb:.4g} MB ({moment.replace('_', ' ')})"
    return line + "; " + ", ".join(map(str, paths))


def recorded_step(callbacks: list[pl.Callback]) -> StepMemoryCallback | None:
    """The memory callback among ``callbacks``, if any."""
    return next((callback for callback in callbacks if isinstance(callback, StepMemoryCallback)), None)

