"""A synchronous parameter server over c10d point-to-point messages (``parallel=param_server``).

Every rank trains a replica on its own data (no DDP); the first ``servers`` ranks also serve: each owns
whole parameters (balanced by size, largest first) and their optimiser state. After backward every rank
sends the gradients of each server's parameters to that server, each server averages what it received
with its own (added in rank order), clips by the global norm (one all-reduce of the parameters' norms,
added up in the parameters' order as one process holding them all would), steps its parameters with the
run's optimiser, and sends them back to every rank. That is averaged-gradient training, through
point-to-point messages instead of an all-reduce: a server receives and sends (N - 1) x its share of the
model per step, so S servers cut the busiest server's traffic by S. torch RPC, which parameter servers
used to be written with, is in maintenance mode; c10d's send/recv run on gloo and NCCL alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import nn

from disttrain.checkpoint.optimizer_state import load_optimizer_state, optimizer_state, optimizer_template
from disttrain.comm.counter import ByteCounter
from disttrain.parallel.clip import owned_grad_norm, scale_to_norm
from disttrain.parallel.zero1 import rebuilt_optimizer


def owners(params: list[nn.Parameter], servers: int) -> list[int]:
    """The server rank that owns each parameter: largest first, each to the server with the fewest values."""
    load = [0] * servers
    owner = [0] * len(params)
    for index in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        server = min(range(servers), key=lambda s: (load[s], s))
        owner[index] = server
        load[server] += params[index].numel()
    return owner


class ParameterServerOptimizer(torch.optim.Optimizer):
    """Wraps the run's optimiser: its param groups (and so the learning-rate schedule) stay here, and the
    servers step their own parameters with a copy of it built over those parameters alone."""

    clips_averaged_gradients = True
    """The servers clip the averaged gradients (the task leaves the local ones alone)."""

    def __init__(self, optimizer: torch.optim.Optimizer, group: dist.ProcessGroup, servers: int,
                 counter: ByteCounter) -> None:
        self.group, self.servers, self.counter = group, servers, counter
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        owner = owners(self.params, servers)
        self.shares = [[p for p, o in zip(self.params, owner, strict=True) if o == s] for s in range(servers)]
        """The parameters each server owns."""
        self.clip_value: float | None = None
        """Clip the averaged gradients to this global norm (set by the task; clipping local gradients would
        not be what an all-reduce run clips)."""
        self.last_norm: torch.Tensor | None = None
        """The global norm of the averaged gradients before clipping, at the last step."""
        self.server_bytes = 0
        """Bytes this rank received and sent as a server (gradients in, parameters out)."""
        owned = {id(p) for p in self.shares[self.rank]} if self.rank < servers else set()
        self.inner = rebuilt_optimizer(optimizer, lambda p: id(p) in owned) if owned else None
        """The run's optimiser over this server's parameters (None on a rank that serves nothing)."""
        self._sources = [g for g in optimizer.param_groups if any(id(p) in owned for p in g["params"])]
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        self.state = self.inner.state if self.inner is not None else {}
        self._optimizer_step_pre_hooks: dict[int, Any] = {}
        self._optimizer_step_post_hooks: dict[int, Any] = {}

    def _buffer(self, params: list[nn.Parameter]) -> torch.Tensor:
        """An empty flat tensor that receives ``params``' values (or gradients)."""
        return torch.empty(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)

    def _exchange(self, sends: dict[int, torch.Tensor], receives: dict[int, torch.Tensor]) -> None:
        """Post every send and receive at once (no order between peers to deadlock on), then wait."""
        peer = lambda r: dist.get_global_rank(self.group, r)  # noqa: E731
        ops = [dist.P2POp(dist.isend, t, peer(r), self.group) for r, t in sends.items()]
        ops += [dist.P2POp(dist.irecv, t, peer(r), self.group) for r, t in receives.items()]
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()
        self.counter.add(sum(t.numel() * t.element_size() for t in sends.values()), len(sends))

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Push gradients to their servers, let the servers step, pull the parameters back."""
        loss = closure() if closure is not None else None
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        others = [r for r in range(self.world) if r != self.rank]
        remote = [s for s in range(self.servers) if s != self.rank and self.shares[s]]
        mine = self.shares[self.rank] if self.rank < self.servers else []
        # push: the gradients of each server's parameters to that server
        received = {r: self._buffer(mine) for r in others} if mine else {}
        self._exchange({s: torch.cat([p.grad.reshape(-1) for p in self.shares[s]]) for s in remote}, received)
        if mine:
            # added in rank order on every server: one fixed order, which a reference can follow bit for bit
            # (float addition is not associative; gloo's ring all-reduce adds each chunk in its own order)
            parts = [received[r] if r != self.rank else torch.cat([p.grad.reshape(-1) for p in mine])
                     for r in range(self.world)]
            total = parts[0]
            for values in parts[1:]:
                total += values
            total /= self.world
            self._unflatten(total, [p.grad for p in mine])
        if self.clip_value:  # every rank joins the norm's all-reduce; one holding no parameters adds zeros
            self.last_norm = owned_grad_norm(self.params, mine, self.group)
            scale_to_norm(mine, self.clip_value, self.last_norm)
        if self.inner is not None:
            self.inner_with_current_hyperparameters().step()
        # pull: each server's parameters back to every rank
        sent = {r: torch.cat([p.reshape(-1) for p in mine]) for r in others} if mine else {}
        pulls = {s: self._buffer(self.shares[s]) for s in remote}
        self._exchange(sent, pulls)
        self.server_bytes += sum(t.numel() * t.element_size() for t in [*received.values(), *sent.values()])
        for server, values in pulls.items():
            self._unflatten(values, list(self.shares[server]))
        return loss

    @staticmethod
    def _unflatten(flat: torch.Tensor, targets: list[torch.Tensor]) -> None:
        offset = 0
        for target in targets:
            target.copy_(flat[offset:offset + target.numel()].view_as(target))
            offset += target.numel()

    def inner_with_current_hyperparameters(self) -> torch.optim.Optimizer | None:
        """The inner optimiser, its groups given the wrapper's learning rate (the schedule drives the wrapper)
        and other hyper-parameters: before each step, and before its state is saved."""
        if self.inner is not None:
            for ours, theirs in zip(self.inner.param_groups, self._sources, strict=True):
                ours.update({k: v for k, v in theirs.items() if k != "params"})
        return self.inner

    def adopt_loaded_state(self) -> None:
        """After the inner optimiser's state was loaded: its hyper-parameters (the learning rate the schedule
        had reached) become the wrapper's, which a learning-rate scheduler's own state does not restore."""
        if self.inner is not None:
            for loaded, source in zip(self.inner.param_groups, self._sources, strict=True):
                source.update({k: v for k, v in loaded.items() if k != "params"})
            self.state = self.inner.state

    def saved_state(self, model: nn.Module) -> dict[str, Any]:
        """What a checkpoint holds of this rank: its server's optimiser state (none on a rank that serves
        nothing), with the hyper-parameters the schedule has reached."""
        inner = self.inner_with_current_hyperparameters()
        return {} if inner is None else optimizer_state(model, inner)

    def state_template(self, model: nn.Module) -> dict[str, Any]:
        """What a load of ``saved_state`` fills."""
        return {} if self.inner is None else optimizer_template(model, self.inner)

    def load_saved_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Take the loaded state, and the learning rate it was saved with."""
        if self.inner is not None:
            load_optimizer_state(model, self.inner, state)
        self.adopt_loaded_state()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every parameter's gradient."""
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()


class ServerTraffic(pl.Callback):
    """The busiest server's bytes per step (gradients received plus parameters sent), for ``results.json``."""

    def __init__(self, servers: int, log_dir: Path) -> None:
        self.servers, self.log_dir = servers, log_dir
        self.result: dict[str, Any] | None = None
        self._start: tuple[int, int] = (0, 0)  # (server bytes, global step) when training started

    def _optimizer(self, trainer: pl.Trainer) -> ParameterServerOptimizer:
        return next(o for o in trainer.optimizers if isinstance(o, ParameterServerOptimizer))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start = (self._optimizer(trainer).server_bytes, trainer.global_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Every rank's server bytes per step, the largest kept (a collective)."""
        optimizer = self._optimizer(trainer)
        steps = max(trainer.global_step - self._start[1], 1)
        busiest = torch.tensor((optimizer.server_bytes - self._start[0]) / steps, device=optimizer.params[0].device)
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX, group=optimizer.group)
        self.result = {"servers": self.servers, "busiest_server_bytes_per_step": round(busiest.item())}
        log = getattr(optimizer, "log", None)
        if log is not None:  # asynchronous: what the servers applied and dropped, and how late
            optimizer.write_log(self.log_dir)
            applied = [e["server_version"] - e["grad_version"] for e in log if e["applied"]]
            counts = torch.tensor([len(applied), len(log) - len(applied)], device=busiest.device)
            latest = torch.tensor(max(applied, default=0), device=busiest.device)
            dist.all_reduce(counts, group=optimizer.group)
            dist.all_reduce(latest, op=dist.ReduceOp.MAX, group=optimizer.group)
            self.result.update(staleness=optimizer.staleness, applied_updates=int(counts[0]),
                               dropped_updates=int(counts[1]), most_versions_late=int(latest))
