"""``benchmarks/optimizers.py``'s own measurements: the optimiser-step clock times the update and not the closure
(forward and backward) that Lightning runs inside ``optimizer.step``, and the steps to a target loss."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

CLOSURE_S = 0.05
"""How long each training step's forward sleeps: far longer than a linear layer's SGD update."""


def _benchmark():
    # loaded by path: "benchmarks" is also the name of a package some dependencies install
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "optimizers.py"
    spec = importlib.util.spec_from_file_location("optimizers_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class SlowForward(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        time.sleep(CLOSURE_S)
        inputs, targets = batch
        return nn.functional.mse_loss(self.net(inputs), targets)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_step_clock_times_the_update_without_the_closure(tmp_path) -> None:
    out = tmp_path / "clock.json"
    clock = _benchmark().StepClock(str(out))
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[clock],
                         gradient_clip_val=1.0, default_root_dir=tmp_path)
    trainer.fit(SlowForward(), DataLoader(data, batch_size=4))
    measured = json.loads(out.read_text())
    assert measured["steps"] == 3  # the first step is left out
    assert 0 < measured["mean_s"] < CLOSURE_S / 2


def test_steps_to_a_target_is_the_first_validation_at_or_below_it() -> None:
    steps_to = _benchmark().steps_to
    curve = [(25.0, 3.1), (50.0, 2.5), (75.0, 2.6), (100.0, 2.4)]
    assert steps_to(curve, 2.5) == 50
    assert steps_to(curve, 2.45) == 100
    assert steps_to(curve, 2.0) is None
