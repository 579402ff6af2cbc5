"""The LightningModule that trains any registered model: loss, step accounting and optimiser wiring; its
evaluation's metrics are kept by ``EvalMetrics`` (``disttrain.rank.eval_metrics``)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from disttrain.checkpoint.optimizer_state import unwrapped
from disttrain.data.spec import DataSpec
from disttrain.fault.steps import StepAgreement
from disttrain.fault.stops import SkippedStep
from disttrain.models.protocol import logits_of
from disttrain.optim import build_optimizer, build_scheduler
from disttrain.optim.groups import drops_steps_on_device
from disttrain.optim.scheduler import apply_rate_of_current_step
from disttrain.parallel.clip import clip_grad_norm, grad_norm, scale_grads
from disttrain.parallel.compile import CUDA_GRAPH_MODES
from disttrain.parallel.strategy import DistTrainStrategy
from disttrain.rank.eval_metrics import EvalMetrics
from disttrain.rank.loss import loss_function
from disttrain.rank.target_mean import StepTargets

FOLD_EVERY = 256
"""Applied batch losses kept before they are added to the epoch's sums (bounds what an epoch holds)."""

# Epoch metrics are logged from torchmetrics' compute(), which has already reduced them over all ranks.
warnings.filterwarnings("ignore", message=r".*It is recommended to use `self.log\(.*sync_dist=True")


EPOCH_LOSS_KEY = "epoch_loss"
"""In a checkpoint: the sum and count of the training losses of the epoch it was saved in, over all ranks."""


class TrainTask(pl.LightningModule):
    """Trains ``net`` on image classification or next-token prediction, as ``spec.kind`` says.

    The parallel strategy replaces ``self.net`` with its wrapped form before the optimiser is built,
    so ``configure_optimizers`` always sees the parameters that are actually trained.
    """

    def __init__(self, net: nn.Module, spec: DataSpec, optim_cfg: Any, scheduler_cfg: Any, total_steps: int,
                 agreement: StepAgreement | None = None, gradients_agree: bool = False,
                 compile_mode: str | None = None, loss_mean: str = "batch"):
        """``compile_mode``: torch.compile's mode for the cross-entropy, as the model's (``disttrain.rank.loss``);
        None: eager. ``loss_mean``: what a step's loss is the mean over (``ExecutionPlan.loss_mean``)."""
        super().__init__()
        self.agreement = agreement or StepAgreement()
        """Agreement of all ranks on preemption requests and non-finite numbers."""
        self.gradients_agree = gradients_agree
        """After backward every rank holds the same gradients (DDP) or shards of them (ZeRO, TP), so their global
        norm is the same number everywhere and decides a non-finite step without a collective of its own; the
        loss and the preemption flag are then reduced on logged steps only. False: every step reduces them."""
        self.net = net
        self.loss_fn = loss_function(compile_mode)
        """The cross-entropy of logits against targets, compiled with the model or eager."""
        self.step_targets = StepTargets(loss_mean) if loss_mean != "batch" else None
        """Where the data masks targets: the step's summed losses and target counts, which make its loss and scale
        its gradients once (``disttrain.rank.target_mean``); None: each micro-batch's mean is its share."""
        self.replays_cuda_graphs = compile_mode in CUDA_GRAPH_MODES
        """Compiled regions replay CUDA graphs: a step's losses are copied out of the graph's memory before the
        next step's replay writes over it, and each training step tells the graphs a new step begins."""
        self.optim_cfg = optim_cfg
        self.scheduler_cfg = scheduler_cfg
        self.total_steps = total_steps
        self._step_loss: list[torch.Tensor] = []
        self._unapplied_losses: list[torch.Tensor] = []
        """This rank's batch losses of the optimiser step being taken, until it is applied or skipped."""
        self._applied_losses: torch.Tensor | None = None
        """``FOLD_EVERY`` slots for the batch losses of applied steps not yet added to the epoch's sums, allocated
        once: each loss is copied in and freed with its step. On a CPU, 256 kept loss tensors pinned glibc's heap
        between the steps' activations: GPT micro's resident memory grew every step, each fresh page a fault."""
        self._applied_count = 0
        """How many of those slots hold a loss."""
        self._epoch_loss_sum: torch.Tensor | None = None
        """Sum of this epoch's finite batch losses (None: no batch yet)."""
        self._epoch_batches: torch.Tensor | None = None
        """How many of them were finite (a tensor: counting needs no host sync)."""
        self._drops_on_device = False
        """The gradient norm's check waits a step (``fault_tolerance.nan_check=next_step``) and the optimiser
        drops a non-finite step on the device (``configure_optimizers`` decides)."""
        self._dropped: torch.Tensor | None = None
        """The device flag of the step being taken: 1.0 where its optimiser dropped it (a deferred check)."""
        self.evaluation = EvalMetrics(spec, self.loss_fn)
        """The validation and test epochs' metrics, which the evaluation hooks add to and log."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """Logits of the wrapped model."""
        return logits_of(self.net(inputs))

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = batch
        logits = logits_of(self.net(inputs))
        return self.loss_fn(logits, targets, "mean"), logits

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """Mean cross-entropy of this rank's micro-batch (Lightning scales it for accumulation); where the data
        masks targets, its sum over the real targets / the micro-batch's target positions, counted for the step
        (``step_targets``)."""
        if self.replays_cuda_graphs:
            torch.compiler.cudagraph_mark_step_begin()
        return self._training_loss(batch)

    def _training_loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """A training micro-batch's loss to run backward on, kept or counted for its step's loss."""
        if self.step_targets is not None:
            inputs, targets = batch
            loss_sum = self.loss_fn(logits_of(self.net(inputs)), targets, "sum")
            self.step_targets.add(loss_sum, targets)
            return loss_sum / targets.numel()
        loss, _ = self._loss(batch)
        self._record_train_loss(loss.detach().clone() if self.replays_cuda_graphs else loss.detach())
        return loss

    def _record_train_loss(self, loss: torch.Tensor) -> None:
        """Keep a batch's loss for its optimiser step's logged value and, once the step is applied, the epoch's
        mean (``_count_applied_step``)."""
        self._step_loss.append(loss)
        self._unapplied_losses.append(loss)

    def _count_applied_step(self, applied: bool, dropped: torch.Tensor | None = None) -> None:
        """Keep the losses of the step just taken for the epoch's mean, or drop them with a step that
        ``nan_policy=skip`` dropped: the step is skipped on every rank alike, so a rank's finite losses of a step
        that another rank's NaN skipped count nowhere either. Kept losses are summed every ``FOLD_EVERY`` and at
        the epoch's end, not per step: five tensor operations per step are felt in a small CNN's step.

        ``dropped``: the device flag of a step the optimiser may have dropped on the device; its losses are kept
        as NaN where it did, which the epoch's sums leave out (no host read)."""
        losses, self._unapplied_losses = self._unapplied_losses, []
        if not applied:
            return
        was_dropped = None if dropped is None else dropped.bool()
        for loss in losses:
            if self._applied_losses is None:
                self._applied_losses = loss.new_empty(FOLD_EVERY, dtype=torch.float32)
            slot = self._applied_losses[self._applied_count]
            slot.copy_(loss)
            if was_dropped is not None:
                slot.masked_fill_(was_dropped, math.nan)
            self._applied_count += 1
            if self._applied_count == FOLD_EVERY:
                self._fold_applied_losses()

    def _fold_applied_losses(self) -> None:
        """Add the kept losses to the epoch's sums."""
        if not self._applied_count or self._applied_losses is None:
            return
        stacked = self._applied_losses[:self._applied_count]
        self._applied_count = 0
        self._add_to_epoch_loss(stacked)

    def _add_to_epoch_loss(self, losses: torch.Tensor) -> None:
        """Add the finite values of ``losses`` (one dimension) and their count to the epoch's sums (tensors: no host
        sync); a non-finite loss counts nowhere."""
        finite = torch.isfinite(losses)
        value, count = torch.where(finite, losses, torch.zeros_like(losses)).sum(), finite.sum().to(losses.dtype)
        if self._epoch_loss_sum is None or self._epoch_batches is None:
            self._epoch_loss_sum, self._epoch_batches = value, count
        else:
            self._epoch_loss_sum, self._epoch_batches = self._epoch_loss_sum + value, self._epoch_batches + count

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Log the optimiser step's loss: the mean over its micro-batches and all ranks (one small reduce that
        also carries the preemption flag); a non-finite loss stops or skips the step on every rank.

        When gradients agree across ranks the reduce happens on logged steps only: a collective per step is a
        synchronisation point that costs most where ranks share cores, and the gradient norm checked in
        ``configure_gradient_clipping`` already catches a non-finite step on every rank alike.

        Where the data masks targets the step's loss and target counts are reduced every step, and the gradients
        scaled to the mean over the step's real targets here, before Lightning clips them (``step_targets``).
        """
        if self.step_targets is not None:
            loss = self._take_target_mean(optimizer.param_groups)
            self._log_step_row(loss, optimizer)
            self._check_finite("the training loss", loss)
            return
        if self.gradients_agree and not self.logs_this_step():
            self._step_loss.clear()
            return
        loss = self.agreement.reduce_loss(self._step_mean(), self.trainer.world_size)
        self._log_step_row(loss, optimizer)
        self._check_finite("the training loss", loss)

    def _take_target_mean(self, param_groups: list[dict[str, Any]]) -> torch.Tensor:
        """The loss of the step being taken over its real targets, once its gradients (of ``param_groups``) are
        scaled to that mean; kept for the epoch's mean, which is then the mean of its steps' losses."""
        if self.step_targets is None:
            raise RuntimeError("the step's loss is the mean of its batches' means: no targets were counted")
        loss, factor = self.step_targets.take(self.agreement, self.trainer.world_size, self.device)
        scale_grads([p for group in param_groups for p in group["params"]], factor)
        self._unapplied_losses.append(loss)
        return loss

    def _step_mean(self) -> torch.Tensor:
        """This rank's mean of the batch losses of the step being taken (the list starts over for the next step)."""
        local = torch.stack(self._step_loss).mean()
        self._step_loss.clear()
        return local

    def _check_finite(self, name: str, value: torch.Tensor) -> None:
        """Stop the run, or skip the step being taken (``SkippedStep``), where ``value`` is not finite."""
        self.agreement.check_finite(name, value, self.global_step + 1)

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        """Lightning's step, except that a step whose closure found non-finite numbers (``nan_policy=skip``)
        leaves parameters and optimiser state as they were; then the gradients are freed."""
        try:
            optimizer.step(closure=optimizer_closure)
        except SkippedStep:
            self._count_applied_step(False)
        else:
            dropped, self._dropped = self._dropped, None
            self._count_applied_step(True, dropped)
        # Lightning zeroes gradients in the next step's closure after its forward (under accumulation, after the
        # next window's first forward): they would sit beside those activations, a large share of the peak of a
        # big model under full checkpointing (benchmarks/README.md, Figures cited elsewhere)
        optimizer.zero_grad(set_to_none=True)

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        """Nothing to zero: ``optimizer_step`` freed the gradients as soon as the optimiser had stepped (a second
        ``zero_grad`` over parameters without gradients still walks every parameter each step)."""

    def logs_this_step(self) -> bool:
        """Whether the optimiser step being taken writes a log row: every ``trainer.log_every_n_steps`` steps
        and the last. Values are logged on those steps only: each ``self.log`` call costs Lightning a walk over
        the stored metric's attributes, a large share of a small CNN's step for a step's five values
        (benchmarks/README.md, Figures cited elsewhere), and the rows in between are never written."""
        done = self.global_step + 1
        return done % self.trainer.log_every_n_steps == 0 or done == self.trainer.max_steps

    def _log_step_row(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """Log an optimiser step's loss and learning rate, called before the step is taken.

        The row is numbered by the step it completes (1 for the first), as the console and the
        checkpoint names count: Lightning's default, the number of steps done before it, is one behind.
        """
        if not self.logs_this_step():
            return
        # off the progress bar: Lightning reads its values back to the host after every batch (rank/progress.py
        # shows the loss instead)
        self.log("train/loss", loss, on_step=True, on_epoch=False)
        self.log("train/lr", float(optimizer.param_groups[0]["lr"]), on_step=True, on_epoch=False)
        self._log_position(self.global_step + 1, on_step=True)

    def _log_position(self, step: int, on_step: bool = False) -> None:
        # a logged "step" numbers the logger row (Lightning then adds no "epoch" of its own)
        self.log("step", float(step), on_step=on_step, on_epoch=not on_step, sync_dist=False)
        if not self.trainer.testing:  # after fit the epoch counter is past the last epoch
            self.log("epoch", float(self.current_epoch), on_step=on_step, on_epoch=not on_step, sync_dist=False)

    def _eval_step(self, stage: str, batch: tuple[torch.Tensor, ...]) -> None:
        """Score an evaluation batch, ``(inputs, targets)`` or ``(inputs, targets, sources)``, into ``stage``'s
        metrics."""
        inputs, targets, *sources = batch
        logits = logits_of(self.net(inputs))
        self.evaluation.add_batch(stage, logits, targets, sources[0] if sources else None)

    def _log_eval_epoch(self, stage: str) -> None:
        """Log ``stage``'s metrics over all ranks, numbered by the steps the evaluated weights have taken."""
        self.log_dict(self.evaluation.take_epoch(stage), prog_bar=stage == "val", sync_dist=False)
        self._log_position(self.global_step)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Accumulate validation loss (and accuracy for images)."""
        self._eval_step("val", batch)

    def on_validation_epoch_end(self) -> None:
        """Log global validation metrics."""
        self._log_eval_epoch("val")

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        """Accumulate test loss (and accuracy for images)."""
        self._eval_step("test", batch)

    def on_test_epoch_end(self) -> None:
        """Log global test metrics."""
        self._log_eval_epoch("test")

    def on_train_epoch_end(self) -> None:
        """Log the epoch's mean training loss over all ranks and applied steps (nan where none was applied)."""
        totals = self._epoch_loss_totals()
        self._epoch_loss_sum = self._epoch_batches = None
        self.log("train/loss_epoch", totals[0] / totals[1])
        self._log_position(self.global_step)

    def _epoch_loss_totals(self) -> torch.Tensor:
        """The epoch's loss sum and batch count so far, over all ranks (a collective: every rank calls it)."""
        self._fold_applied_losses()
        totals = torch.zeros(2, device=self.device)
        if self._epoch_loss_sum is not None and self._epoch_batches is not None:
            totals = torch.stack([self._epoch_loss_sum, self._epoch_batches]).float()
        if dist.is_initialized() and dist.get_world_size() > 1:
            # one collective for sum and count: a torchmetrics mean synchronised its two states with a barrier and
            # two all-gathers each, which a small 2-rank step feels
            dist.all_reduce(totals)
        return totals

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The epoch's loss sum and count so far, over all ranks: a run resumed inside the epoch logs the same
        ``train/loss_epoch`` as the uninterrupted one (every rank saves, so the sum is taken here)."""
        totals = self._epoch_loss_totals().tolist()
        checkpoint[EPOCH_LOSS_KEY] = {"sum": totals[0], "batches": totals[1]}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Continue the saved epoch's loss sums: rank 0 holds the saved totals of all ranks, the others start
        from nothing, so the epoch's reduce adds them once."""
        saved = checkpoint.get(EPOCH_LOSS_KEY)
        if not saved or not saved["batches"]:
            return
        first = not dist.is_initialized() or dist.get_rank() == 0
        self._epoch_loss_sum = torch.tensor(saved["sum"] if first else 0.0, device=self.device)
        self._epoch_batches = torch.tensor(saved["batches"] if first else 0.0, device=self.device)

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip by the global norm of whole parameters, also when some are tensor-parallel shards; log the
        norm before clipping as ``train/grad_norm``; a non-finite norm stops or skips the step."""
        norm = self._gradient_norm(optimizer, gradient_clip_val)
        if norm is None:
            return
        if gradient_clip_val:
            self._log_grad_norm(norm)
        if self._drops_on_device:  # the optimiser skips on the flag; the host reads the norm a step later
            flag = self.agreement.check_finite_later("the gradient norm", norm, self.global_step + 1)
            self._dropped = unwrapped(optimizer).found_inf = flag
        else:  # one scalar read per step, as torch.amp's GradScaler does to skip a step with inf/NaN gradients
            self._check_finite("the gradient norm", norm)

    def _gradient_norm(self, optimizer: torch.optim.Optimizer, clip: float | None,
                       across: dist.ProcessGroup | None = None) -> torch.Tensor | None:
        """The global norm of the step's gradients, before they are clipped to ``clip`` (where given); ``across``:
        a group whose ranks hold other parameters (a pipeline's stages). None where neither clipping nor the
        non-finite check needs it: unless gradients agree, the all-reduced loss guards the step."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if clip:
            return clip_grad_norm(params, clip, across=across)
        return grad_norm(params, across) if self.gradients_agree else None

    def _log_grad_norm(self, norm: torch.Tensor) -> None:
        """Log the gradient norm before clipping, on the steps that write a row."""
        if self.logs_this_step():
            self.log("train/grad_norm", norm, on_step=True, on_epoch=False)

    def on_train_start(self) -> None:
        """Start at the schedule's rate for the step training starts from (a resumed optimiser holds the rate of
        the schedule it was saved under, which another ``max_steps`` changes)."""
        for config in self.trainer.lr_scheduler_configs:
            apply_rate_of_current_step(config.scheduler)

    def configure_optimizers(self) -> dict[str, Any]:
        """Optimiser over the (already wrapped) parameters and a per-step learning-rate schedule."""
        optimizer = build_optimizer(self.optim_cfg, self.net)
        strategy = self.trainer.strategy
        if isinstance(strategy, DistTrainStrategy):  # ZeRO-1 wraps the optimiser; the schedule must drive the wrapper
            if hasattr(optimizer, "attach") and isinstance(self.net, DistributedDataParallel):  # 1-bit Adam
                optimizer.attach(self.net, strategy.comm_counter, strategy.comm_state)
            optimizer = strategy.shard_optimizer(optimizer)
        scheduler = build_scheduler(self.scheduler_cfg, optimizer, self.total_steps)
        # torch's GradScaler sets the optimiser's found_inf itself (16-bit mixed precision)
        self._drops_on_device = self.agreement.defers and drops_steps_on_device(optimizer) and getattr(
            self.trainer.precision_plugin, "scaler", None) is None
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
