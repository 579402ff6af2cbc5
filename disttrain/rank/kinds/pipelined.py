"""Pipeline parallelism: the model is cut into stages and a schedule runs forward and backward of all
micro-batches of a batch at once; the task accumulates, clips and steps itself."""

from __future__ import annotations

from dataclasses import replace
from functools import cached_property, partial
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from disttrain.parallel.pipeline.runtime import PipelineSlot, scaled_cross_entropy
from disttrain.parallel.strategy import StrategyHooks
from disttrain.rank.kinds.base import RunKind
from disttrain.rank.manual_step import ManualStepTask


class PipelineTask(ManualStepTask):
    """The schedule runs each batch's micro-batches; every ``accumulation`` batches the step is taken by hand, its
    gradients clipped by their norm over the pipeline's stages.

    Losses exist on the last stage only; they are summed over the world and divided by the number of
    last-stage ranks (data-parallel x tensor-parallel size) to log the global mean. Where the data masks targets,
    the last stages count the step's summed losses and targets instead, and one reduce per step makes its loss
    and scales every stage's gradients to the mean over its real targets (``disttrain.rank.target_mean``).

    With ``parallel.pipeline.timeline`` the first batch of the second optimiser step (the first has paid
    for warm-up) is timed, and the timeline is gathered and written after training (``on_train_end``).
    """

    def __init__(self, *args: Any, pipeline: PipelineSlot, loss_ranks: int, plots: bool = True, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.plots = plots
        self.pipeline = pipeline
        self.loss_ranks = loss_ranks
        self._train_batches = 0
        self._timed_step: int | None = None

    def _global_mean(self, local_sum: torch.Tensor | None) -> torch.Tensor:
        value = local_sum.detach().clone() if local_sum is not None else torch.zeros((), device=self.device)
        return self.agreement.reduce_loss(value, self.loss_ranks)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Run the schedule; every ``accumulation`` batches take the step."""
        # the first batch of the second optimiser step: the first step paid for allocations and set-up
        record = self._train_batches == self.accumulation
        if record:
            self._timed_step = self.global_step + 1
        self._train_batches += 1
        result = self.pipeline.run(batch[0], batch[1], train=True, record=record)
        if self.step_targets is not None:
            self._count_targets(batch[1], result[0] if result else None, batch_idx)
            return
        # the scaled sum over microbatches x accumulation is this batch's share of the step's mean loss
        batch_loss = self._global_mean(result[0] if result else None) * self.accumulation
        self._record_train_loss(batch_loss)
        if (batch_idx + 1) % self.accumulation == 0:  # the batch losses were global already
            self.take_step(self._step_mean(), across=self.pipeline.pipeline.pp_group)

    def _count_targets(self, targets: torch.Tensor, scaled: torch.Tensor | None, batch_idx: int) -> None:
        """Count a batch's summed loss (last stages: ``scaled`` undone, see ``scaled_cross_entropy``) and targets;
        after the step's last batch, scale the gradients to the step's mean over its real targets and take it."""
        if self.step_targets is None:
            raise RuntimeError("the step's loss is the mean of its batches' means: no targets are counted")
        if scaled is not None:
            self.step_targets.add(scaled.detach() * targets.numel() * self.accumulation, targets)
        if (batch_idx + 1) % self.accumulation == 0:
            loss = self._take_target_mean(self.optimizers().param_groups)
            self.take_step(loss, across=self.pipeline.pipeline.pp_group)

    def on_train_end(self) -> None:
        """With ``parallel.pipeline.timeline``: rank 0 gathers the timed step from its pipeline's ranks and
        writes it into ``plots/`` (once, after training, so no other step waits for it)."""
        from disttrain.parallel.pipeline.timeline import gather_timeline, write_timeline

        pipeline = self.pipeline.pipeline
        if pipeline is None or pipeline.recorder is None:
            return
        timeline = gather_timeline(pipeline.recorder, pipeline.pp_group)
        if not self.trainer.is_global_zero:
            return
        if timeline is None:
            print("disttrain: no pipeline timeline: the run took fewer than 2 optimiser steps", flush=True)
            return
        run_dir = Path(self.trainer.default_root_dir)
        written = write_timeline({"step": self._timed_step, **timeline}, run_dir / "plots", self.plots)
        print(f"disttrain: pipeline timeline, bubble {timeline['bubble_fraction']:.2f}: "
              f"{', '.join(map(str, written))}", flush=True)

    def _eval_step(self, stage: str, batch: tuple[torch.Tensor, ...]) -> None:
        inputs, targets, *sources = batch
        result = self.pipeline.run(inputs, targets, train=False)
        logits = None
        if result is not None:  # last stage: undo the training-time scaling of the loss function
            scaled, logits = result
            loss_sum = scaled.detach() * self.accumulation * targets.numel()
            self.evaluation.add_loss(stage, loss_sum, logits.detach(), targets)
        if sources:  # the last stage's logits of the whole batch (the schedule merges its micro-batches')
            self.evaluation.add_source_losses(stage, logits, targets, sources[0])


class Pipelined(RunKind):
    """Stages on the ranks of each pipeline; the schedule's loss reaches the last stage only."""

    name = "pipelined"
    gradients_agree = False

    @cached_property
    def slot(self) -> PipelineSlot:
        """The slot the strategy fills with the stages and schedule, and the task runs (one per rank)."""
        plan = self.run.plan
        example = torch.zeros(plan.microbatch_shape, dtype=getattr(torch, plan.microbatch_dtype))
        return PipelineSlot(partial(scaled_cross_entropy, divisor=plan.loss_divisor), example)

    def strategy_hooks(self) -> StrategyHooks:
        """The pipeline's slot, beside what a synchronous run hands the strategy."""
        return replace(super().strategy_hooks(), pipeline=self.slot)

    def task(self, net: nn.Module, datamodule: Any) -> tuple[pl.LightningModule, Any]:
        """``PipelineTask``: the schedule per batch, accumulation and clipping by hand."""
        run, cfg = self.run, self.run.train
        task = PipelineTask(net, datamodule.spec, run.optim, run.scheduler, total_steps=self.total_steps(datamodule),
                            agreement=self.agreement, pipeline=self.slot, accumulation=run.batch.accumulation,
                            clip=cfg.trainer.gradient_clip_val, loss_ranks=run.plan.loss_ranks, plots=cfg.plots,
                            loss_mean=run.plan.loss_mean)
        return task, datamodule
