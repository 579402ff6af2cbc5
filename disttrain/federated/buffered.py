"""Buffered asynchronous aggregation (FedBuff, Nguyen et al., 2022) in simulated time.

``clients_per_round`` clients train at once. Each starts from the model the server holds at that moment
and finishes ``speeds.duration`` later; the server takes arrivals in order of finishing time, and once
``buffer_size`` (K) have arrived it steps on ``sum_i s_i w_i d_i / sum_i w_i`` with ``s_i = 1 / sqrt(1 +
staleness_i)`` (staleness: server steps since client i started; ``w_i`` its weight as in FedAvg). A finished
client's slot goes at once to an idle client drawn from the seed, which starts from the server's current
model (for the K-th arrival of a buffer: the model before that buffer's step).

A client's update depends only on the model it started from, so it is computed when the client starts and
held, together with its finishing time, until it arrives: at most ``clients_per_round`` model-sized vectors,
the same on every rank (each rank trains the new clients of its slots, one all-reduce shares them). That
state goes into the checkpoint, so a run resumed after a kill carries on bitwise.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from disttrain.counter_random import seeded_generator
from disttrain.federated.rounds import METRIC_COLUMNS, FederatedRounds, RoundStats, flat, state_tensors

_DRAW_STREAM = 10


def staleness_weight(staleness: int) -> float:
    """FedBuff's discount of an update that is ``staleness`` server steps old."""
    return 1.0 / (1.0 + staleness) ** 0.5


class BufferedRounds:
    """Server steps of FedBuff over the clients of ``rounds`` (which trains them and knows their speeds)."""

    def __init__(self, rounds: FederatedRounds) -> None:
        self.rounds, self.cfg = rounds, rounds.cfg
        self.now = 0.0
        """Simulated time of the last server step."""
        self.version = 0
        """Server steps taken."""
        self.launches = 0
        """Clients started so far (numbers each start: seeds its draw, its batches and its duration)."""
        self.finish = torch.zeros(0, dtype=torch.float64)
        """In flight: finishing times, clients, the version each started from, launch numbers, updates and
        metric rows (one entry per training client)."""
        self.clients = torch.zeros(0, dtype=torch.int64)
        self.started = torch.zeros(0, dtype=torch.int64)
        self.numbers = torch.zeros(0, dtype=torch.int64)
        self.updates = torch.zeros(0)
        self.rows = torch.zeros(0, METRIC_COLUMNS, dtype=torch.float64)

    @property
    def sample_rate(self) -> float:
        """The share of clients training at once (not a per-round sampling rate: no privacy accounting)."""
        return self.rounds.sample_rate

    def _draw(self, busy: set[int]) -> int:
        eligible = self.rounds.eligible
        for index in torch.randperm(len(eligible), generator=seeded_generator(self.rounds.seed, _DRAW_STREAM,
                                                                        self.launches)).tolist():
            client = int(eligible[index])
            if client not in busy:
                return client
        raise RuntimeError("buffered aggregation: no idle client to start")

    def _launch(self, starts: list[float]) -> None:
        """Start one drawn client at each of ``starts`` from the current global model."""
        rounds = self.rounds
        params, buffers = state_tensors(rounds.net)
        model = flat([*params, *buffers])
        busy = set(self.clients.tolist())
        clients = []
        for _ in starts:
            clients.append(self._draw(busy))
            busy.add(clients[-1])
            self.launches += 1
        first = self.launches - len(clients)
        updates = torch.zeros(len(clients), model.numel(), device=model.device)
        rows = torch.zeros(len(clients), METRIC_COLUMNS, dtype=torch.float64)
        for slot, client in enumerate(clients):
            if slot % rounds.world == rounds.rank:
                update, row = rounds.client_update(client, first + slot, model)
                updates[slot], rows[slot] = update, torch.tensor(row, dtype=torch.float64)
        if rounds.group is not None:
            dist.all_reduce(updates, group=rounds.group)
            dist.all_reduce(rows, group=rounds.group)
        numbers = torch.arange(first, self.launches)
        finish = torch.tensor([start + rounds.duration(client, 1, int(number))
                               for start, client, number in zip(starts, clients, numbers, strict=True)],
                              dtype=torch.float64)
        self.finish = torch.cat([self.finish, finish])
        self.clients = torch.cat([self.clients, torch.tensor(clients, dtype=torch.int64)])
        self.started = torch.cat([self.started, torch.full((len(clients),), self.version, dtype=torch.int64)])
        self.numbers = torch.cat([self.numbers, numbers])
        self.updates = torch.cat([self.updates.to(updates).reshape(-1, model.numel()), updates])
        self.rows = torch.cat([self.rows, rows])

    def run(self, step: int) -> tuple[torch.Tensor, RoundStats]:
        """Server step ``step``: the next ``buffer_size`` arrivals' discounted weighted mean update, and the
        step's stats; the clients that take over their slots start from the model before this step."""
        if step != self.version:
            raise RuntimeError(f"buffered aggregation: asked for step {step} at version {self.version}")
        if self.launches == 0:
            self._launch([0.0] * self.cfg.per_round)
        # arrivals in order of finishing time (ties: lower client first)
        order = sorted(range(len(self.finish)), key=lambda i: (float(self.finish[i]), int(self.clients[i])))
        arrived, waiting = order[:self.cfg.buffer], order[self.cfg.buffer:]
        weights = torch.tensor([self.rounds.weight(int(self.clients[i])) for i in arrived], dtype=torch.float64)
        staleness = [self.version - int(self.started[i]) for i in arrived]
        discounts = torch.tensor([staleness_weight(s) for s in staleness], dtype=torch.float64)
        coefficients = (discounts * weights / weights.sum()).to(self.updates)
        update = (coefficients[:, None] * self.updates[arrived]).sum(dim=0)
        starts = [float(self.finish[i]) for i in arrived]
        clients, rows = self.clients[arrived].tolist(), self.rows[arrived]
        self.now = starts[-1]
        keep = torch.tensor(waiting, dtype=torch.int64)
        self.finish, self.clients, self.started = self.finish[keep], self.clients[keep], self.started[keep]
        self.numbers, self.updates, self.rows = self.numbers[keep], self.updates[keep], self.rows[keep]
        self._launch(starts)
        self.version += 1
        return update, self._stats(step, clients, rows, update.numel(), staleness)

    def apply(self, update: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """Hand the step's update to the server optimiser (as ``FederatedRounds.apply``)."""
        self.rounds.apply(update, optimizer)

    def _stats(self, step: int, clients: list[int], rows: torch.Tensor, numel: int,
               staleness: list[int]) -> RoundStats:
        accuracies = rows[:, 0]
        return RoundStats(round=step, clients=clients, train_loss=float(rows[:, 3].mean()),
                          client_acc_mean=float(accuracies.mean()),
                          client_acc_std=float(accuracies.std(unbiased=False)) if len(clients) > 1 else 0.0,
                          client_loss_mean=float(rows[:, 1].mean()), samples=int(rows[:, 4].sum()),
                          bytes_up=len(clients) * numel * 4, bytes_down=len(clients) * numel * 4,
                          sim_time=self.now, staleness=staleness)

    def state_dict(self) -> dict[str, Any]:
        """Everything that carries over between server steps (for the checkpoint)."""
        return {"now": self.now, "version": self.version, "launches": self.launches, "finish": self.finish,
                "clients": self.clients, "started": self.started, "numbers": self.numbers,
                "updates": self.updates.cpu(), "rows": self.rows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Carry on from ``state_dict``'s output."""
        self.now, self.version, self.launches = float(state["now"]), int(state["version"]), int(state["launches"])
        for key in ("finish", "clients", "started", "numbers", "rows"):
            setattr(self, key, state[key].clone())
        device = flat(state_tensors(self.rounds.net)[0][:1]).device
        self.updates = state["updates"].to(device)
