"""Federated learning as a kind of run: each training step is a round in which the drawn clients train locally
and the server steps on their aggregate (the rounds themselves live in ``disttrain.federated``).

The task evaluates and checkpoints like any other (validation of the global model after each round, the
server optimiser's moments in the checkpoint), while its training step is a whole round. The training loader
only counts rounds; the round number is the global step, so a run resumed from a checkpoint continues at the
next round exactly.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

from disttrain.fault.stops import SkippedStep
from disttrain.federated.buffered import BufferedRounds
from disttrain.federated.config import FederatedConfig
from disttrain.federated.finite import RoundSnapshot, first_non_finite
from disttrain.federated.partition import client_partitions
from disttrain.federated.plot import write_round_plot
from disttrain.federated.robust import KRUM_RULES
from disttrain.federated.rounds import FederatedRounds, RoundStats, rounds_epsilon, state_tensors
from disttrain.federated.server import RULES, ServerOptimizer
from disttrain.rank.kinds.base import RunKind
from disttrain.rank.task import TrainTask


class RoundsData(pl.LightningDataModule):
    """The run's data module for federated training: rounds to train, and the wrapped module's evaluation."""

    def __init__(self, inner: Any, rounds: int) -> None:
        super().__init__()
        self.inner, self.rounds = inner, rounds

    def setup(self, stage: str | None = None) -> None:
        """Build the wrapped module's splits."""
        self.inner.trainer = self.trainer  # its loaders shard evaluation over the ranks
        self.inner.setup(stage)

    def train_dataloader(self) -> DataLoader:
        """One item per round (the task reads the round from the global step)."""
        return DataLoader(list(range(self.rounds)), batch_size=1)

    def val_dataloader(self) -> DataLoader:
        """The wrapped module's validation split, sharded over the ranks."""
        return self.inner.val_dataloader()

    def test_dataloader(self) -> DataLoader:
        """The wrapped module's test split, sharded over the ranks."""
        return self.inner.test_dataloader()


class FederatedTask(TrainTask):
    """``TrainTask`` whose training step is a federated round of ``fed`` over the clients' ``parts``."""

    def __init__(self, net: Any, spec: Any, optim_cfg: Any, scheduler_cfg: Any, fed: FederatedConfig,
                 train_set: Any, parts: list[torch.Tensor], clip: float | None, seed: int, **kwargs: Any) -> None:
        super().__init__(net, spec, optim_cfg, scheduler_cfg, total_steps=fed.rounds, **kwargs)
        self.automatic_optimization = False
        self.fed, self.train_set, self.parts, self.clip, self.seed = fed, train_set, parts, clip, seed
        self.rounds: FederatedRounds | BufferedRounds | None = None
        self._buffered_state: dict[str, Any] | None = None
        self.seconds = 0.0
        """Wall time of this process's rounds (local training and aggregation, not validation)."""
        self.history: list[dict[str, Any]] = []
        """Per round: the clients' metrics, bytes, privacy spent, and the global model's validation metrics."""
        self._before: RoundSnapshot | None = None
        """``nan_policy=skip``: the state before the latest round, until the round's model has been checked
        (and validated, where validation follows it)."""

    def setup(self, stage: str) -> None:
        """The round runner, over the data-parallel ranks, once the strategy has placed the model."""
        if self.rounds is None and stage == "fit":
            group = self.trainer.strategy.device_mesh["dp_replicate"].get_group()
            self.rounds = FederatedRounds(self.net, self.train_set, self.parts, self.fed, self.optim_cfg, self.clip,
                                          self.seed, group, self.device)
            if self.fed.mode == "async":
                self.rounds = BufferedRounds(self.rounds)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Asynchronous mode: the clients in flight and the simulated clock go with the checkpoint."""
        super().on_save_checkpoint(checkpoint)
        if isinstance(self.rounds, BufferedRounds):
            checkpoint["federated_buffer"] = self.rounds.state_dict()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Restore the clients in flight (the runner is built in ``setup``, after this hook: held until then)."""
        super().on_load_checkpoint(checkpoint)
        self._buffered_state = checkpoint.get("federated_buffer")

    def training_step(self, batch: Any, batch_idx: int) -> None:
        """One round: local training of the drawn clients, aggregation, the server's step. A non-finite
        training loss or global model stops the run or drops the round's update (``fault_tolerance.nan_policy``);
        a dropped round still counts as a step, with the global model and the server's moments as before it."""
        started = time.perf_counter()
        if self._buffered_state is not None:
            self.rounds.load_state_dict(self._buffered_state)
            self._buffered_state = None
        mean_update, stats = self.rounds.run(self.global_step)
        optimizer = self.optimizers()
        number = self.global_step + 1
        try:
            self._record(stats)  # checks the clients' training loss
        except SkippedStep:
            self.history[-1]["skipped"] = True
            optimizer.step()  # no gradient: the server optimiser changes nothing, and the round is counted
            self.seconds += time.perf_counter() - started
            return
        tensors = [*state_tensors(self.net)[0], *state_tensors(self.net)[1]]
        if self.agreement.nan_policy == "skip":
            self._before = RoundSnapshot(tensors, optimizer.optimizer, number)
        self.rounds.apply(mean_update, optimizer.optimizer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self._check_model(tensors, number)
        self.seconds += time.perf_counter() - started

    def _check_model(self, tensors: list[torch.Tensor], number: int) -> None:
        """Stop, or drop round ``number``'s update, where the global model it left holds a non-finite value."""
        bad = first_non_finite(tensors)
        if bad is None:
            return
        try:
            self.agreement.check_finite(f"the global model after round {number}", torch.tensor(bad), number)
        except SkippedStep:
            self._drop_round()

    def _drop_round(self) -> None:
        """Restore the state before the round just taken (``nan_policy=skip``; the agreement counted it)."""
        self._before.restore()
        self._before = None
        self.history[-1]["skipped"] = True

    def _record(self, stats: RoundStats) -> None:
        loss = self.agreement.reduce_loss(torch.tensor(stats.train_loss, device=self.device), self.trainer.world_size)
        epsilon = rounds_epsilon(self.fed, self.rounds.sample_rate, stats.round + 1)
        row = {"round": stats.round + 1, "train_loss": stats.train_loss, "client_acc_mean": stats.client_acc_mean,
               "client_acc_std": stats.client_acc_std, "client_loss_mean": stats.client_loss_mean,
               "samples": stats.samples, "bytes_up": stats.bytes_up, "bytes_down": stats.bytes_down,
               "clients": stats.clients, "dropped": len(stats.dropped), "sim_time": stats.sim_time}
        if stats.staleness:
            row["staleness_mean"] = sum(stats.staleness) / len(stats.staleness)
        if not math.isnan(epsilon):
            row["epsilon"] = epsilon
        self.history.append(row)
        self.log("train/loss", loss, on_step=True, on_epoch=False, prog_bar=True)
        for key in ("client_acc_mean", "client_acc_std", "client_loss_mean", "bytes_up", "bytes_down", "epsilon",
                    "sim_time", "staleness_mean"):
            if key in row:
                self.log(f"fed/{key}", float(row[key]), on_step=True, on_epoch=False)
        self._log_position(self.global_step + 1, on_step=True)
        self._add_to_epoch_loss(torch.tensor([stats.train_loss], device=self.device))
        self.agreement.check_finite("the training loss", loss, self.global_step + 1)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """The round's row was logged in the training step."""

    def on_validation_epoch_end(self) -> None:
        """Log the global model's validation metrics and keep them with the round's row; a non-finite
        validation loss stops the run or drops the round just taken (``fault_tolerance.nan_policy``)."""
        super().on_validation_epoch_end()
        if self.history and not self.trainer.sanity_checking:
            metrics = self.trainer.callback_metrics
            for key in ("val/acc", "val/loss"):
                if key in metrics:
                    self.history[-1][key] = float(metrics[key])
            if "val/loss" in metrics:
                self._check_validation(metrics["val/loss"])

    def _check_validation(self, loss: torch.Tensor) -> None:
        """A global model whose values are finite can still compute nan (a BatchNorm running variance that
        aggregation made negative): its validation loss tells. Under ``skip`` the round just taken is dropped
        (with validation after every round, the round that broke it); where that round was dropped already there
        is nothing left to drop."""
        number = self.global_step
        if math.isfinite(float(loss)) or (self.agreement.nan_policy == "skip" and (
                self._before is None or self._before.round != number)):
            return
        try:
            self.agreement.check_finite(f"the validation loss after round {number}", loss, number)
        except SkippedStep:
            self._drop_round()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        """The server's optimiser over the global model's parameters (no schedule: one step per round)."""
        server = self.fed.server
        params = [p for p in self.net.parameters() if p.requires_grad]
        return ServerOptimizer(params, RULES[self.fed.strategy], server.resolved_lr(self.fed.strategy), server.beta1,
                               server.beta2, server.tau)

    def summary(self) -> dict[str, Any]:
        """The run's federated figures for results.json."""
        last = self.history[-1] if self.history else {}
        result = {
            "clients": self.fed.clients, "clients_per_round": self.fed.per_round, "rounds": self.global_step,
            "strategy": self.fed.strategy, "partition": self.fed.partition,
            "weighting": self.fed.resolved_weighting, "secure_aggregation": self.fed.secure_aggregation,
            "aggregation": self.fed.aggregation, "attack": asdict(self.fed.attack), "dropout": self.fed.dropout,
            "mode": self.fed.mode, "sim_time": last.get("sim_time"),
            "sim_time_to_val_acc": time_to_accuracy(self.history),
            "bytes_up_per_round": last.get("bytes_up"), "bytes_down_per_round": last.get("bytes_down"),
            "client_acc_mean": last.get("client_acc_mean"), "client_acc_std": last.get("client_acc_std"),
            "client_samples_per_sec": (sum(row["samples"] for row in self.history) / self.seconds
                                       if self.seconds else None),
            "history": [{k: v for k, v in row.items() if k != "clients"} for row in self.history],
        }
        if self.fed.aggregation in KRUM_RULES:
            result["assumed_attackers"] = self.fed.resolved_attackers
            result["assumed_attackers_default"] = self.fed.assumed_attackers is None
        if self.fed.dp.enabled:
            result["privacy"] = {**asdict(self.fed.dp), "sample_rate": self.rounds.sample_rate,
                                 "epsilon": rounds_epsilon(self.fed, self.rounds.sample_rate, self.global_step),
                                 "accountant": "opacus.accountants.RDPAccountant"}
        return result


ACCURACY_LEVELS = (0.5, 0.8, 0.9, 0.95, 0.98)
"""Validation accuracies at which a run reports the simulated time it first reached them."""


def time_to_accuracy(history: list[dict[str, Any]]) -> dict[str, float]:
    """The simulated time at which the global model's validation accuracy first reached each of
    ``ACCURACY_LEVELS`` (levels never reached are left out): what compares synchronous and asynchronous runs."""
    reached: dict[str, float] = {}
    for level in ACCURACY_LEVELS:
        hit = next((row["sim_time"] for row in history if row.get("val/acc", -1.0) >= level), None)
        if hit is not None:
            reached[f"{level:g}"] = hit
    return reached


class Federated(RunKind):
    """Rounds of simulated clients on every rank; the clients' updates travel whole, counted per round."""

    name = "federated"
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
