"""Local SGD and DiLoCo: replicas take ``parallel.sync_every`` local steps, then an outer step averages them."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import lightning.pytorch as pl

from disttrain.parallel.local_sgd import OuterSteps
from disttrain.parallel.strategy import DistTrainStrategy, StrategyHooks
from disttrain.rank.kinds.base import RunKind


class LocalSGD(RunKind):
    """Replicas train apart between outer steps, so they hold different parameters and checkpoint their own."""

    name = "local_sgd"
    gradients_agree = False

    def strategy_hooks(self) -> StrategyHooks:
        """Checkpoints keep every replica's own parameters."""
        return replace(super().strategy_hooks(), per_replica_checkpoints=True)

    def callbacks(self, strategy: DistTrainStrategy) -> list[pl.Callback]:
        """The outer steps, before the exchange meter."""
        p = self.run.train.parallel
        self.outer = OuterSteps(p.sync_every, p.outer, strategy.comm_counter)
        return [self.outer, *super().callbacks(strategy)]

    def results(self, trainer: pl.Trainer) -> dict[str, Any]:
        """How many outer steps were taken, beside the exchange's bytes."""
        return {**super().results(trainer),
                "outer_steps": {"sync_every": self.run.train.parallel.sync_every, "count": self.outer.syncs}}
