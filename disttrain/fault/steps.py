"""What all ranks agree on at each optimiser step: a preemption request, and whether the step's numbers are finite.

Both ride on the one all-reduce that the step's logged loss needs anyway, so agreement costs no extra
collective; a signal handler only sets a flag (a collective inside a handler could interleave with the
one the rank is already in, and deadlock it).
"""

from __future__ import annotations

import math
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from disttrain.fault.config import PREEMPTION_SIGNALS
from disttrain.fault.stops import NonFiniteStep, Preempted, SkippedStep


class HostCopy:
    """A scalar on its way to the host without the host waiting: a GPU value is copied into pinned memory behind
    the work already queued, and ``value()`` waits only for that copy."""

    def __init__(self, value: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if value.device.type == "cuda":
            self._host = torch.empty((), dtype=value.dtype, pin_memory=True)
            self._host.copy_(value.reshape(()), non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:  # a CPU value is there already
            self._host = value.detach()

    def value(self) -> float:
        """The scalar, once the device has written it."""
        if self._event is not None:
            self._event.synchronize()
        return float(self._host)


class StepAgreement:
    """The per-step flags a task reduces with its loss, and the decisions taken on them."""

    def __init__(self, nan_policy: str = "stop", checkpoints: Path | None = None, defers: bool = False) -> None:
        self.nan_policy = nan_policy
        self.defers = defers
        """The gradient norm may be checked a step late (``fault_tolerance.nan_check=next_step``), where the
        optimiser drops a non-finite step on the device."""
        self.checkpoints = checkpoints
        """The run's checkpoint folder, where a stop on non-finite numbers says which checkpoint it kept."""
        self.signalled: int | None = None
        """The preemption signal this rank received (set by the handler), None if none."""
        self.stop_requested = False
        """Some rank was signalled: every rank saves and stops at the end of this step."""
        self.skipped_steps = 0
        """Steps whose update was dropped for non-finite numbers (``nan_policy=skip``)."""
        self._pending: tuple[str, int, HostCopy] | None = None
        """What ``check_finite_later`` left to check: the value's name, its step and its copy on the host."""

    def reduce_loss(self, local: torch.Tensor, divisor: float) -> torch.Tensor:
        """Sum ``local`` over all ranks and divide by ``divisor``; the preemption flag travels in the same call."""
        return self.reduce_sums(local.detach().float().reshape(1))[0] / divisor

    def reduce_sums(self, local: torch.Tensor) -> torch.Tensor:
        """Sum the vector ``local`` over all ranks, the preemption flag in the same call."""
        flag = torch.tensor([float(self.signalled is not None)], dtype=local.dtype, device=local.device)
        packed = torch.cat([local.detach(), flag])
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(packed)
        if packed[-1].item() > 0:
            self.stop_requested = True
        return packed[:-1]

    def check_finite(self, name: str, value: torch.Tensor, step: int) -> None:
        """Act on a global value (identical on every rank) that is not finite: stop or skip, per the policy (a
        deferred check of an earlier step is settled first, so a stop names the first step that was not finite)."""
        self.settle()
        read = value.item()  # one host read, as bool(torch.isfinite(...)) makes, without the op
        if not math.isfinite(read):
            self._act_on_non_finite(name, read, step)
            raise SkippedStep(name)

    def check_finite_later(self, name: str, value: torch.Tensor, step: int) -> torch.Tensor:
        """Check ``value`` (identical on every rank) at the next ``settle()`` instead of now, and return the flag
        (1.0: not finite; on ``value``'s device) that an optimiser which drops steps on the device reads.

        The host does not wait for the device here: it goes on to queue the next step while the device computes
        this one. By the next step's check the value has long been computed, and reading it costs no wait.
        """
        self.settle()
        self._pending = (name, step, HostCopy(value))
        return (~torch.isfinite(value)).to(torch.float32)

    def settle(self) -> None:
        """Act on the value that ``check_finite_later`` left, if any (its step was already dropped on the device:
        under ``nan_policy=stop`` the run stops here, before any later step or checkpoint)."""
        if self._pending is None:
            return
        (name, step, copy), self._pending = self._pending, None
        read = copy.value()
        if not math.isfinite(read):
            self._act_on_non_finite(name, read, step)

    def _act_on_non_finite(self, name: str, value: float, step: int) -> None:
        """Count a dropped step (``nan_policy=skip``), or stop the run."""
        if self.nan_policy == "skip":
            self.skipped_steps += 1
            return
        raise NonFiniteStep(f"{name} is {value} at step {step}: the run stops, {self._kept()} "
                            "(fault_tolerance.nan_policy=skip drops such steps instead)")

    def _kept(self) -> str:
        """Which checkpoint a stop leaves to resume from, in words (read once, on the way out)."""
        from disttrain.checkpoint.folders import newest_complete, saved_step

        newest = newest_complete(self.checkpoints)[0] if self.checkpoints is not None else None
        if newest is None:
            return "before any checkpoint was saved (checkpoint.every_n_train_steps saves more often)"
        return f"keeping its last good checkpoint (step {saved_step(newest)}, {newest})"

    def install(self) -> dict[int, Any]:
        """Replace the preemption signals' handlers (Lightning's SIGTERM handler broadcasts inside the
        handler); returns the previous ones."""
        previous = {sig: signal.getsignal(sig) for sig in PREEMPTION_SIGNALS}
        for sig in PREEMPTION_SIGNALS:
            signal.signal(sig, self._handle)
        return previous

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signalled = signum


class StepDecisions(pl.Callback):
    """Acts on what the ranks agreed at each step: after a preemption signal on any rank, every rank saves
    ``last.ckpt`` and stops; the count of skipped steps travels with the checkpoints."""

    def __init__(self, agreement: StepAgreement) -> None:
        self.agreement = agreement
        self._saved = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Install the handlers after Lightning installed its own (it registers them just before this hook);
        they stay after training, when a late signal has no step left to stop at and is ignored."""
        self.agreement.install()

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        """Save at the end of the step in which the ranks agreed to stop."""
        if not self.agreement.stop_requested or self._saved:
            return
        checkpoint = trainer.checkpoint_callback
        if checkpoint is not None and hasattr(checkpoint, "save_newest"):
            checkpoint.save_newest(trainer)
        wait = getattr(trainer.strategy, "wait_for_checkpoint", None)
        if wait is not None:  # an asynchronous save must land before the process goes
            wait()
        self._saved = True

    def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        """Stop before the next step (by then the saved step's row has reached the loggers, which Lightning
        flushes as the exception passes)."""
        if self._saved:
            raise Preempted(trainer.global_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Act on the last step's deferred check (a non-finite last step stops the run or counts as skipped)."""
        self.agreement.settle()

    def state_dict(self) -> dict[str, int]:
        """The count of skipped steps, so a resumed run keeps counting; a deferred check is settled first, so a
        stop on non-finite numbers writes no checkpoint of the step it stopped at."""
        self.agreement.settle()
        return {"skipped_steps": self.agreement.skipped_steps}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Continue the checkpoint's count of skipped steps."""
        self.agreement.skipped_steps = int(state_dict.get("skipped_steps", 0))
