"""The same clients and server as a Flower ``ClientApp`` and ``ServerApp``, to deploy a federated run across
machines with Flower's engine (``pip install 'disttrain[federated]'``).

Both apps read a run's resolved config (the ``config.yaml`` a run directory holds, or any composed config
saved with ``parallel=federated``). A Flower node's ``partition-id`` (from its node config) is the client it
plays: it trains exactly as the simulated client of that id does (its partition, local steps, optimiser,
clipping, FedProx term), and the server runs Flower's own strategy with the run's server options::

    # client.py                                          # server.py
    from disttrain.launch.flower import client_app    from disttrain.launch.flower import server_app
    app = client_app("path/to/config.yaml")              app = server_app("path/to/config.yaml")

Differential privacy and secure aggregation are disttrain's simulation features; under Flower use its own
DP wrappers and SecAgg+ mods.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from disttrain.federated.config import FederatedConfig
from disttrain.federated.rounds import FederatedRounds, flat, state_tensors


def load_run(config_path: str | Path) -> Any:
    """The validated run of a saved config."""
    from omegaconf import OmegaConf

    from disttrain.config import validate

    return validate(OmegaConf.load(config_path), world_size=1)


class FlowerClient:
    """One process's clients: the run's model, data and partitions, built once and reused for every message."""

    def __init__(self, run: Any) -> None:
        from disttrain.federated.partition import client_partitions
        from disttrain.models import build_model

        cfg = run.train
        torch.manual_seed(cfg.seed)
        net = build_model(run.model, run.datamodule.spec)
        train_set = run.datamodule.datasets["train"]
        parts, _ = client_partitions(cfg.federated, train_set, cfg.seed)
        self.rounds = FederatedRounds(net, train_set, parts, cfg.federated, run.optim, cfg.trainer.gradient_clip_val,
                                      cfg.seed, None, torch.device("cpu"))

    def train(self, state: dict[str, torch.Tensor], server_round: int, client: int) -> tuple[dict[str, torch.Tensor],
                                                                                              float, float]:
        """The client's model after its local training of ``server_round`` (Flower counts rounds from 1), its
        aggregation weight and its mean training loss."""
        net = self.rounds.net
        net.load_state_dict(state)
        params, buffers = state_tensors(net)
        update, row = self.rounds.client_update(client, server_round - 1, flat([*params, *buffers]))
        offset = 0
        with torch.no_grad():
            for tensor in [*params, *buffers]:
                tensor.add_(update[offset:offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
        weight = self.rounds.weight(client) * self.rounds.mean_size
        return {k: v.detach().clone() for k, v in net.state_dict().items()}, weight, row[3]


def client_app(config_path: str | Path) -> Any:
    """A Flower ``ClientApp`` whose ``train`` handler is the run's client training."""
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    app = ClientApp()
    held: dict[str, FlowerClient] = {}

    @app.train()
    def train(message: Message, context: Any) -> Message:
        client = held.setdefault("client", FlowerClient(load_run(config_path)))
        state = message.content["arrays"].to_torch_state_dict()
        server_round = int(message.content["config"]["server-round"])
        trained, weight, loss = client.train(state, server_round, int(context.node_config["partition-id"]))
        content = RecordDict({"arrays": ArrayRecord(trained),
                              "metrics": MetricRecord({"num-examples": weight, "train_loss": loss})})
        return Message(content=content, reply_to=message)

    return app


def flower_strategy(fed: FederatedConfig) -> Any:
    """Flower's strategy for ``fed``: the same rule, server options and clients per round."""
    from flwr.serverapp import strategy as strategies

    fraction = fed.per_round / fed.clients
    common = {"fraction_train": fraction, "min_train_nodes": fed.per_round, "min_available_nodes": fed.clients,
              "fraction_evaluate": 0.0}
    server = fed.server
    if fed.strategy == "fedavg":
        return strategies.FedAvg(**common)
    if fed.strategy == "fedprox":
        return strategies.FedProx(**common, proximal_mu=fed.mu)
    adaptive = {"eta": server.resolved_lr(fed.strategy), "beta_1": server.beta1, "beta_2": server.beta2,
                "tau": server.tau}
    return getattr(strategies, {"fedadam": "FedAdam", "fedyogi": "FedYogi"}[fed.strategy])(**common, **adaptive)


MODEL_FILE = "flower_model.pt"
"""Where the ``ServerApp`` leaves the final global model: this file in the run's ``run_dir``."""


def server_app(config_path: str | Path) -> Any:
    """A Flower ``ServerApp`` that runs the run's strategy for its rounds from its initial model and writes the
    final global model's state dict to ``<run_dir>/flower_model.pt`` (``torch.load(..., weights_only=True)``)."""
    from flwr.app import ArrayRecord
    from flwr.serverapp import ServerApp

    app = ServerApp()

    @app.main()
    def main(grid: Any, context: Any) -> None:
        run = load_run(config_path)
        initial = ArrayRecord(FlowerClient(run).rounds.net.state_dict())
        result = flower_strategy(run.train.federated).start(grid=grid, initial_arrays=initial,
                                                            num_rounds=run.train.federated.rounds)
        path = Path(run.train.run_dir) / MODEL_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(result.arrays.to_torch_state_dict(), path)

    return app
