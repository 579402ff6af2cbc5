"""A training batch run inside Lightning's epoch loop without its per-call wrappers.

Lightning's epoch loop runs a batch of automatic optimisation through a closure object built from three partials,
and calls every hook through a dispatcher that formats a debug message, opens a profiler context and looks the hook
up by name: about 20 dispatches per batch. Called directly, one linear layer on the digits takes 37 us less per
step (median step 734 -> 697 us, ``benchmarks/direct_step.py``; a plain loop takes about 400 us): 5% of a step
that small. On the digits CNN's 14.8 ms step the difference is within what a shared machine varies.

``DirectStep`` takes the place of ``_TrainingEpochLoop.advance`` on one trainer: the same hooks in the same order
with the same arguments, the same progress counts, closure result and logging, for the case disttrain's tasks
run (automatic optimisation, one optimiser, no gradient accumulation). Any other batch (a loop restarting mid-epoch,
accumulation switched on by a callback, a callback skipping backward) goes to Lightning's own ``advance``. Where
nothing overrides a hook, its call is left out (the batch transform before transfer); a loss returned as a tensor
is not divided by an accumulation count of 1; ``DirectHookPrecision`` calls the hooks around backward and before
the optimiser step of a 32-bit run directly. These, with the batch read's tensor indices (``disttrain.data.base``),
took one linear layer's median step from 671 to 579 us (``benchmarks/README.md``).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.loops.fetchers import _DataFetcher, _DataLoaderIterDataFetcher
from lightning.pytorch.loops.optimization.automatic import Closure, ClosureResult
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.model_helpers import is_overridden


def run_batches_directly(trainer: pl.Trainer, task: pl.LightningModule, takes_index: bool) -> None:
    """Let ``DirectStep`` run ``trainer``'s training batches where it can (see the module's docstring).

    ``takes_index``: whether ``task.training_step`` takes the batch index (decided once by the caller). Tasks that
    optimise manually, or a Lightning whose epoch loop lacks what ``DirectStep`` drives, keep Lightning's loop."""
    loop = trainer.fit_loop.epoch_loop
    needs = ("batch_progress", "automatic_optimization", "val_loop", "scheduler_progress",
             "_num_ready_batches_reached", "batch_idx")
    if not task.automatic_optimization or not all(hasattr(loop, name) for name in needs):
        return
    loop.advance = DirectStep(loop, takes_index)


def precision_arguments(precision: str, direct: bool) -> dict[str, Any]:
    """The ``Trainer``'s precision argument: ``DirectHookPrecision`` for 32-bit training where batches run directly
    (``direct``), else Lightning's plugin for ``precision``."""
    return {"plugins": [DirectHookPrecision()]} if direct and precision == "32-true" else {"precision": precision}


class DirectStep:
    """One training batch of automatic optimisation, as ``_TrainingEpochLoop.advance`` runs it (Lightning 2.5-2.6),
    with hooks called directly."""

    def __init__(self, loop: Any, takes_index: bool) -> None:
        self.loop = loop
        self.lightning_advance = loop.advance
        """Lightning's own ``advance``, for the batches this does not run."""
        self.takes_index = takes_index
        self.transforms_before_transfer: bool | None = None
        """Whether the task or the data module overrides ``on_before_batch_transfer``; where neither does, Lightning's
        dispatch to the default (which returns the batch) is skipped: 11 us a step with one linear layer."""

    def __call__(self, data_fetcher: _DataFetcher) -> None:
        """Fetch, move and train on one batch, then step the schedules and call the batch-end hooks."""
        loop = self.loop
        trainer = loop.trainer
        if (loop.restarting or trainer.accumulate_grad_batches != 1 or loop.automatic_optimization._skip_backward
                or isinstance(data_fetcher, _DataLoaderIterDataFetcher)):
            self.lightning_advance(data_fetcher)
            return
        loop.val_loop.restarting = False
        strategy = trainer.strategy
        task = strategy.lightning_module
        batch, _, __ = next(data_fetcher)
        batch_idx = loop.batch_idx + 1
        progress = loop.batch_progress
        progress.is_last_batch = data_fetcher.done
        batch = trainer.precision_plugin.convert_input(batch)
        if self.transforms_before_transfer is None:  # decided at the first batch, when the trainer holds its data
            self.transforms_before_transfer = any(
                is_overridden("on_before_batch_transfer", owner) for owner in (task, trainer.datamodule) if owner)
        if self.transforms_before_transfer:
            batch = task._on_before_batch_transfer(batch, dataloader_idx=0)
        batch = strategy.batch_to_device(batch, dataloader_idx=0)
        progress.increment_ready()
        trainer._logger_connector.on_batch_start(batch)
        output: dict[str, Any] | None = None
        skip_rest_of_epoch = False
        if batch is None:
            loop._warning_cache.warn("train_dataloader yielded None. If this was on purpose, ignore this warning...")
        else:
            call_callbacks(trainer, task, "on_train_batch_start", batch, batch_idx)
            skip_rest_of_epoch = call_task(task, "on_train_batch_start", batch, batch_idx) == -1
            strategy.on_train_batch_start(batch, batch_idx)
            if skip_rest_of_epoch:
                progress.increment_by(0, is_last_batch=True)
            else:
                progress.increment_started()
                output = self._optimise(trainer, task, batch, batch_idx)
        progress.increment_processed()
        self._step_schedules(task, "step", loop.batch_idx)
        if loop._num_ready_batches_reached():
            self._step_schedules(task, "epoch", trainer.current_epoch)
        if skip_rest_of_epoch:
            raise StopIteration
        call_callbacks(trainer, task, "on_train_batch_end", output, batch, batch_idx)
        call_task(task, "on_train_batch_end", output, batch, batch_idx)
        trainer._logger_connector.on_batch_end()
        progress.increment_completed()
        trainer._logger_connector.update_train_step_metrics()

    def _step_schedules(self, task: pl.LightningModule, interval: str, index: int) -> None:
        """Step the schedules of ``interval`` (step or epoch; ``index``: of the batch or epoch, from 0) whose
        frequency divides ``index + 1``, as ``update_lr_schedulers(interval, update_plateau_schedulers=False)`` does
        without accumulation; plateau schedules wait for the metrics that Lightning's loop steps them on."""
        loop = self.loop
        for config in loop.trainer.lr_scheduler_configs:
            if not config.reduce_on_plateau and config.interval == interval and (index + 1) % config.frequency == 0:
                loop.scheduler_progress.increment_ready()
                call_task(task, "lr_scheduler_step", config.scheduler, None)
                loop.scheduler_progress.increment_completed()

    def _optimise(self, trainer: pl.Trainer, task: pl.LightningModule, batch: Any, batch_idx: int) -> dict[str, Any]:
        """The training step, zeroing, backward and optimiser step of Lightning's automatic optimisation: the task's
        ``optimizer_step`` gets a closure that the optimiser calls."""
        strategy = trainer.strategy
        counts = self.loop.automatic_optimization.optim_progress.optimizer
        optimizer = trainer.optimizers[0]
        epoch = trainer.current_epoch
        step_arguments = (batch, batch_idx) if self.takes_index else (batch,)
        results: list[ClosureResult] = []

        def closure() -> torch.Tensor | None:
            with torch.enable_grad():  # optimisers call their closure with gradients off
                output = call_task(task, "training_step", *step_arguments, through=strategy.training_step)
                if output is None and trainer.world_size > 1:
                    raise RuntimeError(
                        "Skipping the `training_step` by returning None in distributed training is not supported.")
                # a tensor is the loss itself: Lightning would divide it by the accumulation count, 1 here (x / 1 is x,
                # yet one more operation forward and one more node for backward)
                result = ClosureResult(output) if isinstance(output, torch.Tensor) else \
                    ClosureResult.from_training_step_output(output)
                results.append(result)
                if result.closure_loss is None:
                    Closure.warning_cache.warn("`training_step` returned `None`. If this was on purpose, ignore this "
                                               "warning...")
                counts.zero_grad.increment_ready()
                call_callbacks(trainer, task, "on_before_zero_grad", optimizer)
                call_task(task, "on_before_zero_grad", optimizer)
                counts.zero_grad.increment_started()
                call_task(task, "optimizer_zero_grad", epoch, batch_idx, optimizer)
                counts.zero_grad.increment_completed()
                if result.closure_loss is not None:
                    call_task(task, "backward", result.closure_loss, optimizer, through=strategy.backward)
                return result.loss

        counts.step.increment_ready()
        call_task(task, "optimizer_step", epoch, batch_idx, strategy._lightning_optimizers[0], closure)
        counts.step.increment_completed()
        if not results:
            raise MisconfigurationException("The closure hasn't been executed: the optimiser's step must call it.")
        result = results[-1]
        return {} if result.loss is None else result.asdict()


def call_callbacks(trainer: pl.Trainer, task: pl.LightningModule, hook: str, *args: Any) -> None:
    """Call ``hook`` of every callback that has it, in the trainer's order, with the task's hook name set (what
    ``self.log`` inside reads), as Lightning's dispatcher does."""
    before = task._current_fx_name
    task._current_fx_name = hook
    for callback in trainer.callbacks:
        method = getattr(callback, hook)
        if method is not None:  # a hook left to the base class is hidden (disttrain.rank.hook_dispatch)
            method(trainer, task, *args)
    task._current_fx_name = before


def call_task(task: pl.LightningModule, hook: str, *args: Any, through: Any = None, **kwargs: Any) -> Any:
    """The task's ``hook`` (or ``through``, the strategy's method of that name) on ``args`` and ``kwargs``, with the
    hook's name set; None where the task hides the hook."""
    method = through or getattr(task, hook)
    if method is None:
        return None
    before = task._current_fx_name
    task._current_fx_name = hook
    output = method(*args, **kwargs)
    task._current_fx_name = before
    return output


class DirectHookPrecision(Precision):
    """Lightning's 32-bit precision plugin, calling the hooks around backward and before the optimiser step (and the
    clipping hook) directly rather than through Lightning's dispatchers: seven dispatches a step, each a profiler
    context, a debug message and a lookup by name."""

    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]
        """The ``on_before_backward`` hooks of the callbacks, then of the task."""
        call_callbacks(module.trainer, module, "on_before_backward", tensor)
        call_task(module, "on_before_backward", tensor)
        return tensor

    def post_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]
        """The loss without its graph; the ``on_after_backward`` hooks of the callbacks, then of the task."""
        closure_loss = tensor.detach()
        call_callbacks(module.trainer, module, "on_after_backward")
        call_task(module, "on_after_backward")
        return closure_loss

    def _after_closure(self, model: pl.LightningModule, optimizer: Any) -> None:
        """The ``on_before_optimizer_step`` hooks, then (automatic optimisation) the task's clipping hook with the
        trainer's clipping settings. A private method of Lightning 2.5-2.6's plugin (between the closure and the
        optimiser's step): a Lightning without it runs its own, with its dispatchers."""
        trainer = model.trainer
        call_callbacks(trainer, model, "on_before_optimizer_step", optimizer)
        call_task(model, "on_before_optimizer_step", optimizer)
        if isinstance(model, pl.LightningModule) and model.automatic_optimization:
            call_task(model, "configure_gradient_clipping", optimizer, gradient_clip_val=trainer.gradient_clip_val,
                      gradient_clip_algorithm=trainer.gradient_clip_algorithm)
