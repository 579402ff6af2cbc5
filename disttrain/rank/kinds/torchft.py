"""torchft replica groups (``fault_tolerance.engine=torchft``): each replica of ``dp_replicate`` is a group that
trains on when another fails; a restarted group copies a live group's state and rejoins at the next step.

The task steps by hand (Lightning's manual optimisation): a step that the groups do not commit takes no
optimiser or scheduler step, so Lightning's global step stays equal to the Manager's count of committed steps;
under automatic optimisation an uncommitted step would still be counted and the group would never be healed.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from disttrain.config.run import RunConfig
from disttrain.fault.config import restart_count
from disttrain.fault.replica_groups import replica_group
from disttrain.fault.replica_report import fault_tolerance_section, summary_line
from disttrain.fault.replica_rows import SHADOW_NAME, csv_file, fill_missing_rows, job_loggers
from disttrain.fault.replica_state import PEER_CHECKPOINT, load_peer_state, peer_state
from disttrain.fault.replica_steps import ReplicaSteps
from disttrain.fault.steps import StepAgreement
from disttrain.lightning_internals import count_stepped_batches, forget_step_values
from disttrain.parallel.clip import scale_grads
from disttrain.parallel.strategy import DistTrainStrategy, StrategyHooks
from disttrain.rank.kinds.base import RunKind
from disttrain.rank.manual_step import ManualStepTask
from disttrain.rank.target_mean import mean_and_factor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


PEER_EPOCH_LOSS = "peer_epoch_loss"
"""In a state served to a restarted or healing group: the serving rank's own part of the epoch's loss sums."""


class ReplicaTask(ManualStepTask):
    """The quorum before a step's first micro-batch, the mean over the groups after its last backward, and the
    optimiser step only when the groups commit it."""

    def __init__(self, *args: Any, steps: ReplicaSteps, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.steps = steps
        self._committed = False
        """Whether the current batch committed a step."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """One micro-batch: forward and backward (the group's own exchange on the step's last one only)."""
        if batch_idx % self.accumulation == 0:
            self.steps.begin_step()
        loss = self._training_loss(batch)
        last = (batch_idx + 1) % self.accumulation == 0
        if last:
            self.manual_backward(loss / self.accumulation)
            self._finish_step()
        else:
            with self.trainer.strategy.block_backward_sync():
                self.manual_backward(loss / self.accumulation)

    def _finish_step(self) -> None:
        """Average gradients and loss over the groups, then take the step if the groups commit it. Where the data
        masks targets, the group's loss sum and target counts are averaged with the gradients, which are then
        scaled to the mean over the real targets of the groups' batches (``disttrain.rank.target_mean``)."""
        params = [p for group in self.optimizers().param_groups for p in group["params"]]
        grads = [_local(p.grad) for p in params if p.grad is not None]
        if self.step_targets is None:
            loss = self.agreement.reduce_loss(self._step_mean(), self.trainer.world_size).reshape(1).clone()
            self.steps.average([*grads, loss])
        else:
            totals = self.step_targets.reduced(self.agreement, self.device)
            self.steps.average([*grads, totals])
            mean, factor = mean_and_factor(totals)
            scale_grads(params, factor)
            loss, self._unapplied_losses = mean.reshape(1), [mean]
        # the epoch's mean is of the steps' losses over the groups (the logged ones), not of this group's batches:
        # rank r of every group then holds the same sums, which a restarted group copies from its source
        self._unapplied_losses = [loss[0]] * len(self._unapplied_losses)
        self._committed = self.take_step(loss[0], commit=self.steps.commit)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """No step committed yet in this batch (see ``on_train_batch_end``)."""
        self._committed = False

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        """Keep Lightning's logger rows on the committed steps.

        Lightning writes a row after a batch when its count of batches that stepped, plus one, is a multiple of
        ``log_every_n_steps``; it counts a batch whose step the groups did not commit, and every micro-batch of an
        accumulating step, although no optimiser step was taken. Counted so, the rows moved one batch later after
        the first uncommitted step, repeated the last logged values there, and the run's last row was never
        written. Here the count is the committed steps (Lightning adds this batch once it has decided on the
        row), and a batch that committed no step leaves no step values for a row to repeat."""
        count_stepped_batches(self.trainer, self.global_step - 1)
        if not self._committed:
            forget_step_values(self.trainer)

    def epoch_loss_part(self) -> dict[str, float]:
        """This rank's own part of the epoch's loss sum and count (no collective: it is read while the rank serves
        its state, and rank r of another group may not be serving)."""
        self._fold_applied_losses()
        if self._epoch_loss_sum is None or self._epoch_batches is None:
            return {"sum": 0.0, "batches": 0.0}
        return {"sum": float(self._epoch_loss_sum), "batches": float(self._epoch_batches)}

    def take_epoch_loss_part(self, part: dict[str, float]) -> None:
        """Continue the epoch from a peer rank's part of its loss sums (``epoch_loss_part``) instead of this
        rank's own, which misses the steps the peer committed and this group did not."""
        self._applied_count = 0
        self._epoch_loss_sum = torch.tensor(part["sum"], device=self.device)
        self._epoch_batches = torch.tensor(part["batches"], device=self.device)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A checkpoint's epoch loss sums, or a peer's part of them (a restarted group's state)."""
        super().on_load_checkpoint(checkpoint)
        if PEER_EPOCH_LOSS in checkpoint:
            self.take_epoch_loss_part(checkpoint[PEER_EPOCH_LOSS])


class ReplicaCounters(pl.Callback):
    """Carries the group's counts of committed, uncommitted and short steps in checkpoints and healed states."""

    def __init__(self, steps: ReplicaSteps) -> None:
        self.steps = steps

    def state_dict(self) -> dict[str, Any]:
        """The counts so far."""
        return {"counts": dict(self.steps.counts)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the saved (or the source group's) counts."""
        self.steps.counts.update(state_dict.get("counts", {}))


class TorchFT(RunKind):
    """Replica groups under a torchft Manager; the group's own layout (DDP of one rank, FSDP2 within an HSDP
    replica) is applied as for a synchronous run of the group's ranks."""

    name = "torchft"

    def __init__(self, run: RunConfig, agreement: StepAgreement) -> None:
        super().__init__(run, agreement)
        self.group, self.groups = replica_group() or (0, 1)
        cfg = run.train
        self.log_dir = Path(cfg.run_dir) / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        samples = run.batch.micro_size * run.batch.accumulation * run.layout.dp
        self.steps = ReplicaSteps(cfg.fault_tolerance, self.group, self.groups, samples, self.log_dir,
                                  send=self._send, receive=self._receive)
        self.trainer: pl.Trainer | None = None
        self._peer: dict[str, Any] | None = None

    def task(self, net: nn.Module, datamodule: Any) -> tuple[pl.LightningModule, Any]:
        """``ReplicaTask``: the torchft step protocol around each step's micro-batches."""
        run = self.run
        task = ReplicaTask(net, datamodule.spec, run.optim, run.scheduler, total_steps=self.total_steps(datamodule),
                           agreement=self.agreement, gradients_agree=True, steps=self.steps,
                           accumulation=run.batch.accumulation, clip=run.train.trainer.gradient_clip_val,
                           loss_mean=run.plan.loss_mean)
        return task, datamodule

    def strategy_hooks(self) -> StrategyHooks:
        """The group's slot of the data, who writes checkpoints, and a live group's state to resume from."""
        return replace(super().strategy_hooks(), replica_slot=(self.group, self.groups),
                       checkpoint_gate=self.writes_checkpoints, in_memory_checkpoint=self._peer_checkpoint)

    def callbacks(self, strategy: DistTrainStrategy) -> list[pl.Callback]:
        """Count the steps, beside the exchange meter."""
        return [ReplicaCounters(self.steps), *super().callbacks(strategy)]

    def resume_from(self, trainer: pl.Trainer) -> str | None:
        """Join the groups; a restarted group takes the next step's quorum now and, where the others are ahead,
        resumes from a live group's state (``PEER_CHECKPOINT``) instead of a checkpoint on disk."""
        self.trainer = trainer
        self.steps.start()
        if not restart_count():
            return None
        self.steps.take_quorum()
        self.steps.quorum_taken = True  # the task's first step must not ask for another
        return PEER_CHECKPOINT if self._peer is not None else None

    def _peer_checkpoint(self, path: Any, model: nn.Module, optimizers: list[Any]) -> dict[str, Any] | None:
        """Where a fit resumes from ``PEER_CHECKPOINT``: load the state a live group sent (once) and return the rest
        of it; None for a checkpoint on disk."""
        if path != PEER_CHECKPOINT or self._peer is None:
            return None
        peer, self._peer = self._peer, None
        return load_peer_state(peer, model, optimizers)

    def _send(self) -> dict[str, Any]:
        if self.trainer is None or not self.trainer.training:
            raise RuntimeError("this group is not training yet: it cannot serve its state")
        return {**peer_state(self.trainer), PEER_EPOCH_LOSS: self.trainer.lightning_module.epoch_loss_part()}

    def _receive(self, state: dict[str, Any]) -> None:
        trainer = self.trainer
        if trainer is None or not trainer.training:  # before fit: restored as a checkpoint (resume_from)
            self._peer = state
            return
        # a running group that fell behind (it did not commit a step the others committed): same data position,
        # so weights, optimiser, schedule, the step count and the epoch's loss sums are all it needs
        rest = load_peer_state(state, trainer.lightning_module, trainer.optimizers)
        trainer.strategy.weights_replaced()
        trainer.lightning_module.take_epoch_loss_part(rest[PEER_EPOCH_LOSS])
        for config, saved in zip(trainer.lr_scheduler_configs, rest["lr_schedulers"], strict=True):
            config.scheduler.load_state_dict(saved)
        progress = trainer.fit_loop.epoch_loop.manual_optimization.optim_step_progress
        for counts in (progress.total, progress.current):
            counts.ready = counts.started = counts.completed = int(rest["global_step"])
        counters = rest["callbacks"].get(ReplicaCounters.__qualname__)
        if counters:
            self.steps.counts.update(counters["counts"])

    def writes_checkpoints(self) -> bool:
        """One group writes the checkpoints on disk: the first of the current step's quorum."""
        manager = self.steps.manager
        return manager is None or manager.participating_rank() == 0

    def writes_results(self, trainer: pl.Trainer) -> bool:
        """Rank 0 of the group that writes checkpoints writes results.json."""
        return trainer.is_global_zero and self.writes_checkpoints()

    def results(self, trainer: pl.Trainer) -> dict[str, Any]:
        """The ``fault_tolerance`` section: groups, restarts with causes and rejoin times, short and uncommitted
        steps, the quorum's time per step; its one line is printed by the group that writes results."""
        section = fault_tolerance_section(self.steps, self.run.train.fault_tolerance, self.log_dir)
        if self.writes_results(trainer):
            target = csv_file(job_loggers(self.run.yaml))  # this group's own loggers are a shadow's, unless group 0
            if target is not None:  # the rows of steps that group 0 missed, from the groups that trained them
                shadows = [self.log_dir / SHADOW_NAME.format(group=g) / "metrics.csv" for g in range(1, self.groups)]
                section["rows_from_other_groups"] = fill_missing_rows(target, shadows)
            print(summary_line(section), flush=True)
        # this rank's degrees are its group's; the job's ranks are every group's
        return {**super().results(trainer), "fault_tolerance": section,
                "world_size": self.groups * self.run.layout.world_size}

    def close(self) -> None:
        """Leave the groups (the Manager's servers and the heartbeat)."""
        self.steps.stop()
