"""``DirectStep`` (with ``DirectHookPrecision``) runs a training batch as Lightning's epoch loop and precision plugin
do: the same hooks in the same order, with the same arguments and hook names, the same weights, optimiser state,
logged values and loop progress (what a checkpoint saves), across epoch ends, validation and a batch-start hook that
ends the epoch early."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from disttrain.rank.direct_step import DirectHookPrecision, DirectStep, precision_arguments, run_batches_directly

BATCH_HOOKS = ("on_train_batch_start", "on_before_zero_grad", "on_before_backward", "on_after_backward",
               "on_before_optimizer_step", "on_train_batch_end")


def describe(value: Any) -> Any:
    """A hook argument as something comparable between two runs (tensors by value, optimisers by class)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.detach().clone())
    if isinstance(value, dict):
        return {key: describe(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [describe(item) for item in value]
    if isinstance(value, torch.optim.Optimizer | pl.core.optimizer.LightningOptimizer):
        return type(value).__name__
    return value


class Recorder(pl.Callback):
    """Notes every per-batch hook: its name, the task's hook name while it runs, the step and its arguments."""

    def __init__(self, events: list) -> None:
        self.events = events

    def __getattribute__(self, name: str) -> Any:
        if name in BATCH_HOOKS:
            def hook(trainer: pl.Trainer, task: pl.LightningModule, *args: Any) -> None:
                self.events.append(("callback", name, task._current_fx_name, trainer.global_step, describe(args)))
            return hook
        return super().__getattribute__(name)


class Task(pl.LightningModule):
    """Two layers and AdamW under clipping; logs from its step and hooks; ends epoch 1 early at ``stop_at``."""

    def __init__(self, events: list, stop_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.events = events
        self.stop_at = stop_at

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        inputs, targets = batch
        loss = torch.nn.functional.mse_loss(self.net(inputs), targets)
        self.log("train/loss", loss, on_step=True, on_epoch=True)
        self.events.append(("task", "training_step", self._current_fx_name, batch_idx, describe(loss)))
        return {"loss": loss, "extra": batch_idx}

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        inputs, targets = batch
        self.log("val/loss", torch.nn.functional.mse_loss(self.net(inputs), targets))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        self.events.append(("task", "on_train_batch_start", self._current_fx_name, batch_idx))
        return -1 if self.current_epoch == 1 and batch_idx == self.stop_at else None

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.parameters()]))
        self.log("train/grad_norm", norm)
        self.events.append(("task", "on_before_optimizer_step", self._current_fx_name, describe(norm)))

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.events.append(("task", "on_train_batch_end", self._current_fx_name, describe(outputs)))

    def configure_optimizers(self) -> dict:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.05)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class TensorTask(Task):
    """Returns the loss itself, and halves the inputs before the batch moves to the device."""

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> Any:
        return super().training_step(batch, batch_idx)["loss"]

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        self.events.append(("task", "on_before_batch_transfer", self._current_fx_name, describe(batch)))
        inputs, targets = batch
        return inputs / 2, targets


def fit(direct: bool, stop_at: int | None = None, accumulate: int = 1, task_class: type = Task) -> dict[str, Any]:
    """Three epochs of five batches, validated every third batch; what each run leaves to compare."""
    events: list = []
    task = task_class(events, stop_at)
    generator = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(20, 4, generator=generator), torch.randn(20, 1, generator=generator))
    trainer = pl.Trainer(max_epochs=3, callbacks=[Recorder(events)], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                         gradient_clip_val=0.5, val_check_interval=3, limit_val_batches=2, num_sanity_val_steps=0,
                         accumulate_grad_batches=accumulate, **precision_arguments("32-true", direct))
    if direct:
        run_batches_directly(trainer, task, takes_index=True)
        step = trainer.fit_loop.epoch_loop.advance
        assert isinstance(step, DirectStep)
        fallbacks = []
        lightning_advance = step.lightning_advance
        step.lightning_advance = lambda fetcher: (fallbacks.append(1), lightning_advance(fetcher))
    trainer.fit(task, DataLoader(data, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2)),
                DataLoader(data, batch_size=4))
    return {"events": events, "weights": {k: v.clone() for k, v in task.state_dict().items()},
            "optimizer": trainer.optimizers[0].state_dict(), "logged": dict(trainer.logged_metrics),
            "loops": trainer.fit_loop.state_dict(), "global_step": trainer.global_step,
            "fallbacks": len(fallbacks) if direct else None}


def assert_same(ours: Any, theirs: Any) -> None:
    """Bitwise equal: both runs do the same operations in the same order."""
    if isinstance(theirs, torch.Tensor):
        assert torch.equal(ours, theirs)
    elif isinstance(theirs, dict):
        assert ours.keys() == theirs.keys()
        for key in theirs:
            assert_same(ours[key], theirs[key])
    elif isinstance(theirs, list | tuple):
        assert len(ours) == len(theirs)
        for mine, other in zip(ours, theirs, strict=True):
            assert_same(mine, other)
    else:
        assert ours == theirs


@pytest.mark.parametrize(("stop_at", "task_class"), [(None, Task), (2, Task), (None, TensorTask)],
                         ids=["whole_epochs", "epoch_ended_by_a_hook", "loss_returned_and_batch_transformed"])
def test_a_direct_batch_is_lightnings_batch(stop_at, task_class):
    lightning, direct = fit(False, stop_at, task_class=task_class), fit(True, stop_at, task_class=task_class)
    assert direct["fallbacks"] == 0
    assert lightning["global_step"] == (15 if stop_at is None else 12)
    transforms = [event for event in lightning["events"] if event[1] == "on_before_batch_transfer"]
    assert len(transforms) == (15 + 6 if task_class is TensorTask else 0)  # training batches, validation batches
    assert [event[:3] for event in direct["events"]] == [event[:3] for event in lightning["events"]]
    for key in ("events", "weights", "optimizer", "logged", "loops", "global_step"):
        assert_same(direct[key], lightning[key])


def test_accumulation_is_left_to_lightning():
    lightning, direct = fit(False, accumulate=2), fit(True, accumulate=2)
    assert direct["fallbacks"] == 15
    for key in ("weights", "optimizer", "loops"):
        assert_same(direct[key], lightning[key])


def test_the_runner_takes_the_direct_step_unless_told_not_to(tmp_path, monkeypatch):
    from disttrain.checkpoint.io import load_items
    from disttrain.launch.job import train
    from tests.conftest import compose_config, logged_metric
    from tests.test_run import step_losses

    direct_batches = []
    direct_call = DirectStep.__call__
    monkeypatch.setattr(DirectStep, "__call__", lambda self, fetcher: (
        direct_batches.append(type(self.loop.trainer.precision_plugin)), direct_call(self, fetcher))[1])
    cnn = ["logger=csv", "callbacks=none", "trainer.run_test=false", "trainer.max_steps=6",
           "trainer.limit_val_batches=1", "trainer.log_every_n_steps=1"]
    train(compose_config([*cnn, "trainer.direct_step=false"], tmp_path / "lightning"))
    assert direct_batches == []
    train(compose_config(cnn, tmp_path / "direct"))
    assert direct_batches == [DirectHookPrecision] * 6
    assert step_losses(tmp_path / "direct") == step_losses(tmp_path / "lightning")
    norms = [logged_metric(tmp_path / run, "train/grad_norm") for run in ("direct", "lightning")]
    assert len(norms[0]) == 6 and norms[0] == norms[1]
    states = []
    for run in ("direct", "lightning"):
        states.append(load_items(tmp_path / run / "checkpoints" / "last.ckpt", lambda place: True))
    assert_same(*states)  # weights and optimiser state
