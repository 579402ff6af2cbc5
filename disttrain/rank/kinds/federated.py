"""Federated learning: each training step is a round in which drawn clients train locally and the server steps
on their aggregate (``disttrain.federated``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch import nn

from disttrain.federated.plot import write_round_plot
from disttrain.federated.task import FederatedTask, RoundsData, client_partitions
from disttrain.rank.kinds.base import RunKind


class Federated(RunKind):
    """Rounds of simulated clients on every rank; the clients' updates travel whole, counted per round."""

    name = "federated"
    exchanges_through_ddp = False
    gradients_agree = False

    def steps_per_epoch(self, datamodule: Any) -> int:
        """A round is an optimiser step of the global model, and the rounds are one epoch."""
        return self.run.train.federated.rounds

    def task(self, net: nn.Module, datamodule: Any) -> tuple[pl.LightningModule, Any]:
        """The task whose training step is a round, and the data module that counts rounds."""
        run, cfg = self.run, self.run.train
        train_set = datamodule.datasets["train"]
        parts, _ = client_partitions(cfg.federated, train_set, cfg.seed)
        self.task_module = FederatedTask(net, datamodule.spec, run.optim, run.scheduler, fed=cfg.federated,
                                         train_set=train_set, parts=parts, clip=cfg.trainer.gradient_clip_val,
                                         seed=cfg.seed, agreement=self.agreement)
        return self.task_module, RoundsData(datamodule, cfg.federated.rounds)

    def results(self, trainer: pl.Trainer) -> dict[str, Any]:
        """The rounds' figures (the clients' updates are counted there, not as a gradient exchange); global
        batches do not apply: see ``federated.client_samples_per_sec``."""
        summary = self.task_module.summary()
        if trainer.is_global_zero and self.run.train.plots:
            write_round_plot(summary["history"], Path(self.run.train.run_dir) / "plots")
        return {"federated": summary, "samples_per_sec": None}
