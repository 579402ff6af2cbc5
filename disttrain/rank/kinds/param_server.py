"""Parameter servers: ranks push gradients to the servers that own each parameter and pull parameters back,
synchronously or with bounded staleness (``parallel.staleness``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from disttrain.checkpoint.optimizer_state import unwrapped
from disttrain.parallel.async_server import AsyncParameterServerOptimizer
from disttrain.parallel.param_server import ParameterServerOptimizer, ServerTraffic
from disttrain.parallel.strategy import DistTrainStrategy, StrategyHooks
from disttrain.rank.kinds.base import RunKind
from disttrain.rank.task import TrainTask


class ServerTask(TrainTask):
    """``TrainTask`` whose synchronous servers clip the averaged gradients, which only they hold: clipping each
    rank's own would not be what an all-reduce run clips."""

    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Hand synchronous servers the norm to clip to; asynchronous ones apply each rank's gradient, clipped
        here as any task clips."""
        server = unwrapped(optimizer)
        if server.clips_averaged_gradients:
            server.clip_value = gradient_clip_val
        else:
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)


class ParameterServer(RunKind):
    """The optimiser step is the servers' exchange; asynchronous replicas checkpoint their own parameters."""

    name = "param_server"
    gradients_agree = False
    task_class = ServerTask

    def strategy_hooks(self) -> StrategyHooks:
        """The task's optimiser runs on the servers, behind the push and pull; asynchronous replicas hold
        parameters of different versions, so checkpoints keep every rank's own."""
        p = self.run.train.parallel

        def wrap(optimizer: torch.optim.Optimizer, strategy: DistTrainStrategy) -> torch.optim.Optimizer:
            group = strategy.device_mesh["dp_replicate"].get_group()
            if p.staleness:
                names = {id(param): name for name, param in strategy.lightning_module.named_parameters()}
                return AsyncParameterServerOptimizer(optimizer, group, p.servers, strategy.comm_counter, p.staleness,
                                                     names)
            return ParameterServerOptimizer(optimizer, group, p.servers, strategy.comm_counter)

        return StrategyHooks(wrap_optimizer=wrap, per_replica_checkpoints=bool(p.staleness))

    def callbacks(self, strategy: DistTrainStrategy) -> list[pl.Callback]:
        """The servers' traffic, before the exchange meter."""
        self.traffic = ServerTraffic(self.run.train.parallel.servers, Path(self.run.train.run_dir) / "logs")
        return [self.traffic, *super().callbacks(strategy)]

    def results(self, trainer: pl.Trainer) -> dict[str, Any]:
        """The busiest server's bytes per step, beside the exchange's."""
        return {**super().results(trainer), "param_server": self.traffic.result}
