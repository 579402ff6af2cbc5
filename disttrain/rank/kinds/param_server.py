"""Parameter servers: ranks push gradients to the servers that own each parameter and pull parameters back,
synchronously or with bounded staleness (``parallel.staleness``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from disttrain.parallel.async_server import AsyncParameterServerOptimizer
from disttrain.parallel.param_server import ParameterServerOptimizer, ServerTraffic
from disttrain.parallel.strategy import DistTrainStrategy, OptimizerWrap
from disttrain.rank.kinds.base import RunKind


class ParameterServer(RunKind):
    """The optimiser step is the servers' exchange; asynchronous replicas checkpoint their own parameters."""

    name = "param_server"
    gradients_agree = False

    @property
    def per_replica_checkpoints(self) -> bool:  # type: ignore[override]
        """Asynchronous replicas hold parameters of different versions."""
        return bool(self.run.train.parallel.staleness)

    def optimizer_wrap(self) -> OptimizerWrap | None:
        """The task's optimiser runs on the servers, behind the push and pull."""
        p = self.run.train.parallel

        def wrap(optimizer: torch.optim.Optimizer, strategy: DistTrainStrategy) -> torch.optim.Optimizer:
            group = strategy.device_mesh["dp_replicate"].get_group()
            if p.staleness:
                names = {id(param): name for name, param in strategy.lightning_module.named_parameters()}
                return AsyncParameterServerOptimizer(optimizer, group, p.servers, strategy.comm_counter, p.staleness,
                                                     names)
            return ParameterServerOptimizer(optimizer, group, p.servers, strategy.comm_counter)

        return wrap

    def callbacks(self, strategy: DistTrainStrategy) -> list[pl.Callback]:
        """The servers' traffic, before the exchange meter."""
        self.traffic = ServerTraffic(self.run.train.parallel.servers, Path(self.run.train.run_dir) / "logs")
        return [self.traffic, *super().callbacks(strategy)]

    def results(self, trainer: pl.Trainer) -> dict[str, Any]:
        """The busiest server's bytes per step, beside the exchange's."""
        return {**super().results(trainer), "param_server": self.traffic.result}
