"""One federated round over the ranks: draw clients, train each locally, aggregate, take the server step.

Every rank holds the global model and simulates the drawn clients whose slot in the round falls to it
(slot ``i`` on rank ``i mod world``). What crosses ranks is one model-sized vector per round (each rank's sum
of its clients' weighted updates, plus the weight: masked residues under secure aggregation) and one small
table of client metrics; no data. Under a robust rule (``aggregation`` other than mean) the rule needs each
update on its own, so the round's updates cross as one ``(clients, numel)`` matrix instead. All ranks then
hold the same aggregate and take the same server step, so the global model stays identical everywhere
without a broadcast. Clients that drop out of a round (``dropout``) are chosen from the seed and the round
and never report; the aggregate is over the rest.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from disttrain.counter_random import seeded_generator
from disttrain.federated import attack, privacy, robust, secure, speeds
from disttrain.federated.client import ClientData, copy_state, evaluate, train_locally
from disttrain.federated.config import FederatedConfig
from disttrain.federated.partition import Partition, labels_of

METRIC_COLUMNS = 5  # accuracy, evaluated loss, evaluated targets, training loss, samples trained on


@dataclass
class RoundStats:
    """What one round did, the same on every rank."""

    round: int
    """The round's number, from 0."""
    clients: list[int]
    """The clients drawn."""
    train_loss: float
    """Mean local training loss of the drawn clients."""
    client_acc_mean: float
    """Mean accuracy of the global model (as received) on each drawn client's own data."""
    client_acc_std: float
    """Spread (standard deviation) of those accuracies."""
    client_loss_mean: float
    """Mean loss of the received global model on the clients' own data."""
    samples: int
    """Samples the drawn clients trained on (counted once per local step)."""
    bytes_up: int
    """Bytes the drawn clients sent to the server (one update each)."""
    bytes_down: int
    """Bytes the server sent to them (the global model each)."""
    update_norms: list[float] = field(default_factory=list)
    """This rank's clients' update norms before privacy clipping."""
    dropped: list[int] = field(default_factory=list)
    """Drawn clients that dropped out before reporting (their metrics are left out)."""
    sim_time: float = 0.0
    """Simulated time at the end of the round (``disttrain.federated.speeds``), from the start of the run."""
    staleness: list[int] = field(default_factory=list)
    """Asynchronous mode: how many server steps old each applied update was."""


class Clients(Sequence):
    """Client ``c``'s ``ClientData``, built when asked for from the partition (no per-client objects kept)."""

    def __init__(self, dataset: Dataset, parts: Partition, batch_size: int, seed: int) -> None:
        self.dataset, self.parts, self.batch_size, self.seed = dataset, parts, batch_size, seed

    def __len__(self) -> int:
        return len(self.parts)

    def __getitem__(self, client: int) -> ClientData:  # type: ignore[override]
        return ClientData(self.dataset, self.parts[client], client % len(self.parts), self.batch_size, self.seed)


def state_tensors(net: nn.Module) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    """The global model's trained parameters and its floating-point buffers (both aggregated)."""
    params = [p for p in net.parameters() if p.requires_grad]
    buffers = [b for b in net.buffers() if b.is_floating_point()]
    return params, buffers


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One fp32 vector of ``tensors``."""
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


class FederatedRounds:
    """Runs the rounds of ``cfg`` on the global model ``net`` over ``group`` (None: this process alone)."""

    def __init__(self, net: nn.Module, dataset: Dataset, parts: Partition | list[torch.Tensor], cfg: FederatedConfig,
                 optim_cfg: Any, clip: float | None, seed: int, group: dist.ProcessGroup | None,
                 device: torch.device) -> None:
        self.net, self.cfg, self.optim_cfg, self.clip, self.seed = net, cfg, optim_cfg, clip, seed
        self.group, self.device = group, device
        parts = parts if isinstance(parts, Partition) else Partition.of(parts)
        self.data = Clients(dataset, parts, cfg.batch_size, seed)
        self.eligible = torch.nonzero(parts.sizes() > 0).flatten()
        """The clients that hold samples (a tensor: a list of 10,000 ints would cost more than the indices)."""
        self.mean_size = len(parts.indices) / len(parts)
        self.worker = copy.deepcopy(net)  # the drawn clients train in turn on this copy
        self.hostile = attack.attackers(cfg.attack.fraction, len(parts), seed) if cfg.attack.enabled else set()
        self.slow = speeds.slow_clients(cfg.slow_fraction, len(parts), seed)
        self._clock = [0.0]  # simulated time at the end of each round so far (entry r + 1 for round r)
        labels = labels_of(dataset) if cfg.attack.kind == "label_flip" else None
        self.classes = int(labels.max()) + 1 if labels is not None else 0
        self.rank = dist.get_rank(group) if group is not None else 0
        self.world = dist.get_world_size(group) if group is not None else 1

    @property
    def sample_rate(self) -> float:
        """The chance that a client is drawn in a round."""
        return self.cfg.per_round / len(self.eligible)

    def drawn(self, round_index: int) -> list[int]:
        """The clients of round ``round_index`` (ascending), drawn from the seed and the round alone."""
        count = self.cfg.per_round
        if count >= len(self.eligible):
            return self.eligible.tolist()
        order = torch.randperm(len(self.eligible), generator=seeded_generator(self.seed, 3, round_index))
        return sorted(self.eligible[order[:count]].tolist())

    def batches(self, client: int, round_index: int) -> list[Any]:
        """Client ``client``'s local batches of the round."""
        data = self.data[client]
        if self.cfg.local_epochs:
            indices = data.epoch_batches(round_index, self.cfg.local_epochs)
        else:
            indices = data.step_batches(round_index, self.cfg.local_steps)
        return [data.collate(batch) for batch in indices]

    def client_update(self, client: int, round_index: int, start: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        """Train client ``client`` from the global model; its update (params then float buffers, fp32) and its
        metrics row (accuracy, loss and count on its own data before training, mean training loss, samples)."""
        params, buffers = state_tensors(self.worker)
        global_params, global_buffers = state_tensors(self.net)
        copy_state([*global_params, *global_buffers], [*params, *buffers])
        data = self.data[client]
        evaluated = [data.collate(batch) for batch in data.eval_batches(self.cfg.eval_batches)]
        correct, loss_sum, count = evaluate(self.worker, evaluated, self.device)
        draw = seeded_generator(self.seed, 4, round_index, client)
        torch.manual_seed(int(torch.randint(0, 2**62, (), generator=draw)))
        anchor = [p.detach() for p in global_params] if self.cfg.mu else None
        batches = self.batches(client, round_index)
        hostile = client in self.hostile
        if hostile and self.cfg.attack.kind == "label_flip":
            batches = attack.flip_labels(batches, self.classes)
        train_loss = train_locally(self.worker, batches, self.optim_cfg, self.clip, self.cfg.mu, anchor, self.device)
        update = flat([*params, *buffers]) - start
        if hostile:
            update = attack.poison(update, self.cfg.attack.kind, self.cfg.attack.scale, self.seed, round_index, client)
        samples = float(sum(len(targets) for _, targets in batches))
        return update, [correct / max(count, 1), loss_sum / max(count, 1), float(count), train_loss, samples]

    def weight(self, client: int) -> float:
        """The client's weight in the aggregate: its samples relative to the mean partition, or 1."""
        if self.cfg.resolved_weighting == "uniform":
            return 1.0
        return len(self.data[client]) / self.mean_size

    def duration(self, client: int, *run: int) -> float:
        """Simulated time of one local training of ``client`` (``run`` names it: see ``speeds.duration``)."""
        cfg = self.cfg
        return speeds.duration(self.seed, client, client in self.slow, cfg.latency_spread, cfg.slowdown, *run)

    def elapsed(self, round_index: int) -> float:
        """Simulated time at the end of round ``round_index``: each round lasts as long as its slowest reporting
        client (recomputed from the seed, so a resumed run carries on the same clock)."""
        while len(self._clock) <= round_index + 1:
            r = len(self._clock) - 1
            clients = self.drawn(r)
            lost = set(self.dropped(r, clients))
            self._clock.append(self._clock[-1] + max(self.duration(c, 0, r) for c in clients if c not in lost))
        return self._clock[round_index + 1]

    def dropped(self, round_index: int, clients: list[int]) -> list[int]:
        """The drawn clients that drop out of round ``round_index`` mid-round (after the round's setup, before
        reporting): ``round(dropout x drawn)`` of them, from the seed and the round alone."""
        count = round(self.cfg.dropout * len(clients))
        if not count:
            return []
        order = torch.randperm(len(clients), generator=seeded_generator(self.seed, 9, round_index))
        return sorted(clients[int(i)] for i in order[:count])

    def run(self, round_index: int) -> tuple[torch.Tensor, RoundStats]:
        """Train this rank's share of the round's clients and aggregate over all ranks: the global model's
        weighted mean update of the clients that report (params then float buffers, fp32, on the model's
        device) and the round's stats."""
        clients = self.drawn(round_index)
        lost = set(self.dropped(round_index, clients))
        survivors = [client for client in clients if client not in lost]
        params, buffers = state_tensors(self.net)
        start = flat([*params, *buffers])
        secure_sum, separate = self.cfg.secure_aggregation, self.cfg.robust
        total = torch.zeros(start.numel() + 1, dtype=torch.int64 if secure_sum else torch.float32,
                            device="cpu" if secure_sum else start.device)
        # a robust rule compares the updates one by one: each slot's row is filled by the rank that trains it
        rows = torch.zeros(len(clients) if separate else 0, start.numel(), device=start.device)
        metrics = torch.zeros(len(clients), METRIC_COLUMNS, dtype=torch.float64)
        norms = []
        dp = self.cfg.dp
        if secure_sum:  # the round's setup: every drawn client's keys, before anyone drops
            secrets = {client: secure.client_secrets(self.seed, round_index, client) for client in clients}
            publics = {client: secure.public_key(secrets[client].key) for client in clients}
        for slot, client in enumerate(clients):
            if slot % self.world != self.rank or client in lost:
                continue
            update, row = self.client_update(client, round_index, start)
            if dp.enabled:
                update, norm = privacy.clip_update(update, dp.clip)
                norms.append(norm)
            weight = self.weight(client)
            contribution = torch.cat([update * weight, update.new_tensor([weight])])
            if separate:
                rows[slot] = update
            elif secure_sum:
                masked = secure.mask(secure.encode(contribution.cpu()), client, publics, secrets[client])
                total = torch.remainder(total + masked, secure.MODULUS)
            else:
                total += contribution
            metrics[slot] = torch.tensor(row, dtype=torch.float64)
        if self.group is not None:
            dist.all_reduce(rows if separate else total, group=self.group)
            dist.all_reduce(metrics, group=self.group)
        if separate:
            cfg, kept = self.cfg, [slot for slot, client in enumerate(clients) if client not in lost]
            mean_update = robust.aggregate(rows[kept], cfg.aggregation, cfg.trim_fraction, cfg.resolved_attackers)
        else:
            if secure_sum:
                total = secure.unmask(total, clients, survivors, self.seed, round_index)
            summed = secure.decode(total).float().to(start.device) if secure_sum else total
            mean_update = summed[:-1] / summed[-1]
        if dp.noise_multiplier:
            std = dp.noise_multiplier * dp.clip / len(survivors)
            mean_update += privacy.gaussian_noise(mean_update.numel(), std, self.seed, round_index).to(mean_update)
        reported = [slot for slot, client in enumerate(clients) if client not in lost]
        return mean_update, self._stats(round_index, clients, survivors, metrics[reported], start.numel(), norms)

    def apply(self, mean_update: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """Hand the parameters' share of the update to the server optimiser (as a negated gradient) and set the
        float buffers to the clients' weighted mean."""
        params, buffers = state_tensors(self.net)
        offset = 0
        with torch.no_grad():
            for param in params:
                param.grad = -mean_update[offset:offset + param.numel()].view_as(param).to(param.dtype)
                offset += param.numel()
            for buffer in buffers:
                buffer.add_(mean_update[offset:offset + buffer.numel()].view_as(buffer).to(buffer.dtype))
                offset += buffer.numel()

    def _stats(self, round_index: int, clients: list[int], survivors: list[int], metrics: torch.Tensor, numel: int,
               norms: list[float]) -> RoundStats:
        accuracies = metrics[:, 0]
        element = 8 if self.cfg.secure_aggregation else 4
        per_client = numel if self.cfg.robust else numel + 1  # robust rules take no weight
        return RoundStats(
            round=round_index, clients=clients, train_loss=float(metrics[:, 3].mean()),
            client_acc_mean=float(accuracies.mean()),
            client_acc_std=float(accuracies.std(unbiased=False)) if len(survivors) > 1 else 0.0,
            client_loss_mean=float(metrics[:, 1].mean()), samples=int(metrics[:, 4].sum()),
            bytes_up=len(survivors) * per_client * element, bytes_down=len(clients) * numel * 4, update_norms=norms,
            dropped=sorted(set(clients) - set(survivors)), sim_time=self.elapsed(round_index),
        )


def rounds_epsilon(cfg: FederatedConfig, sample_rate: float, rounds: int) -> float:
    """Privacy spent after ``rounds`` rounds (inf when clipping adds no noise; nan without privacy)."""
    if not cfg.dp.enabled:
        return math.nan
    return privacy.epsilon(cfg.dp.noise_multiplier, sample_rate, rounds, cfg.dp.delta)
