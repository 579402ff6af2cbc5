"""Lightning skips the per-batch hooks that a callback or the task leaves as its base class wrote them (empty),
and still calls every hook that something overrides or hands in."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import LambdaCallback
from torch.utils.data import DataLoader, TensorDataset

from disttrain.rank.hook_dispatch import EVAL_BATCH_HOOKS, TRAIN_STEP_HOOKS, skip_step_hooks_left_alone

STEPS = 4


class Tiny(pl.LightningModule):
    """One linear layer; counts the one per-batch hook it overrides."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.batch_ends = 0

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, targets = batch
        return torch.nn.functional.mse_loss(self.layer(inputs), targets)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.training_step(batch, batch_idx)

    def on_train_batch_end(self, *_: object) -> None:
        self.batch_ends += 1

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class CountsBackward(pl.Callback):
    def __init__(self) -> None:
        self.calls = 0

    def on_after_backward(self, *_: object) -> None:
        self.calls += 1


class InheritsTheCount(CountsBackward):
    """Overrides nothing itself: its parent's hook is its own."""


def fit(callbacks: list[pl.Callback], task: pl.LightningModule, skip: bool) -> None:
    if skip:
        skip_step_hooks_left_alone(callbacks, task)
    data = TensorDataset(torch.randn(STEPS * 2, 3), torch.randn(STEPS * 2, 1))
    trainer = pl.Trainer(max_steps=STEPS, callbacks=callbacks, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                         limit_val_batches=1, num_sanity_val_steps=0)
    trainer.fit(task, DataLoader(data, batch_size=2), DataLoader(data, batch_size=2))


@pytest.mark.parametrize("skip", [False, True])
def test_lightning_calls_the_empty_hooks_only_where_they_are_left_visible(skip, monkeypatch):
    """A counting stand-in for the base class's empty hook: Lightning calls it for each callback every step,
    unless the hook is skipped; hooks overridden in a class, inherited from a parent that overrides them or
    handed in on the instance run every step either way."""
    empty_calls = []
    monkeypatch.setattr(pl.Callback, "on_before_backward", lambda self, *_: empty_calls.append(type(self)))
    handed_in = []
    callbacks = [CountsBackward(), InheritsTheCount(),
                 LambdaCallback(on_before_backward=lambda *_: handed_in.append(1))]
    task = Tiny()
    fit(callbacks, task, skip)
    assert callbacks[0].calls == callbacks[1].calls == len(handed_in) == task.batch_ends == STEPS
    assert len(empty_calls) == (0 if skip else 2 * STEPS)


def test_only_hooks_inherited_unchanged_are_hidden():
    callbacks = [CountsBackward(), InheritsTheCount()]
    task = Tiny()
    skip_step_hooks_left_alone(callbacks, task)
    for callback in callbacks:
        assert callable(callback.on_after_backward)
        assert all(getattr(callback, hook) is None for hook in TRAIN_STEP_HOOKS + EVAL_BATCH_HOOKS
                   if hook != "on_after_backward")
    assert callable(task.on_train_batch_end) and task.on_before_backward is None
    assert callable(task.training_step) and callable(task.configure_optimizers)  # not per-batch hooks: untouched
    # Lightning reads the signature of the module's evaluation batch hooks before it evaluates
    assert all(callable(getattr(task, hook)) for hook in EVAL_BATCH_HOOKS)


def test_each_task_class_declares_its_own_training_step_signature_as_lightning_reads_it():
    """Lightning asks on every ``self.log`` whether ``training_step`` takes the batch iterator: a subclass whose
    step does must answer yes, the task's own step no, each from the signature its class declares."""
    from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature

    from disttrain.rank.task import TrainTask

    class IteratorTask(TrainTask):
        def training_step(self, dataloader_iter: object) -> torch.Tensor:  # type: ignore[override]
            raise NotImplementedError

    for task, takes_iterator in ((TrainTask, False), (IteratorTask, True)):
        assert "__signature__" in vars(task.training_step)
        assert is_param_in_hook_signature(task.training_step, "dataloader_iter", explicit=True) is takes_iterator
