"""The parameter server with asynchronous updates and bounded staleness (``parallel.staleness`` > 0).

Each server applies every worker's gradient on its own, in the order the gradients arrive, to its own copy
of its parameters, and answers that worker at once with the parameters as they are then and their version
(the number of updates applied so far). A worker computes its next gradient on the parameters of its last
answer, so its gradient may be some versions old when it arrives; one more than ``staleness`` versions old
is dropped (and the worker gets the current parameters), so no applied update is more than ``staleness``
versions late. Every server keeps the log of what it applied and dropped (``logs/server<rank>.jsonl``).

The gradients are clipped by each worker before they leave, as each is applied alone. Receiving "from any
rank" and message tags are gloo's (NCCL has neither), so the messages travel on a gloo group through the
CPU on any device. The ranks still meet once per step in the all-reduce of the logged loss, so a slow
worker delays the others: what this gives is the asynchronous update rule, not a free-running worker.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from disttrain.comm.counter import ByteCounter
from disttrain.parallel.param_server import ParameterServerOptimizer
from disttrain.parallel.zero1 import rebuilt_optimizer

PUSH_HEADER, PUSH_DATA, REPLY_HEADER, REPLY_DATA = 1, 2, 3, 4  # message tags


class AsyncParameterServerOptimizer(ParameterServerOptimizer):
    """``ParameterServerOptimizer`` whose servers apply each worker's gradient alone, at most ``staleness``
    versions late."""

    clips_averaged_gradients = False

    def __init__(self, optimizer: torch.optim.Optimizer, group: dist.ProcessGroup, servers: int,
                 counter: ByteCounter, staleness: int, names: dict[int, str]) -> None:
        super().__init__(optimizer, group, servers, counter)
        self.staleness = staleness
        self.messages = dist.new_group(backend="gloo")  # any-source receives and tags, on every device
        self.versions = [0] * servers
        """The version of each server's parameters this rank's replica holds."""
        self.version = 0
        """This server's version: updates applied so far."""
        self.log: list[dict[str, int | bool]] = []
        """What this server did with each gradient: worker, its version, the server's version, applied."""
        mine = self.shares[self.rank] if self.rank < servers else []
        self.names = [names[id(p)] for p in mine]
        self.copies = [nn.Parameter(p.detach().clone()) for p in mine]
        """This server's own copy of its parameters, which the workers' replicas lag behind."""
        copy_of = {id(p): c for p, c in zip(mine, self.copies, strict=True)}
        self.inner = rebuilt_optimizer(optimizer, lambda p: id(p) in copy_of, lambda p: copy_of[id(p)]) \
            if mine else None
        self.state = self.inner.state if self.inner is not None else {}

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([t.detach().reshape(-1) for t in tensors]).cpu()

    def _serve(self, worker: int, grad_version: int, grads: torch.Tensor) -> None:
        """Apply (or drop) one worker's gradient to this server's copy."""
        applied = self.version - grad_version <= self.staleness
        self.log.append({"worker": worker, "grad_version": grad_version,
                         "server_version": self.version, "applied": applied})
        if applied:
            self._unflatten(grads.to(self.copies[0].device), [c.grad for c in self._with_grads()])
            self.inner_with_current_hyperparameters().step()
            self.version += 1

    def _with_grads(self) -> list[nn.Parameter]:
        for c in self.copies:
            if c.grad is None:
                c.grad = torch.zeros_like(c)
        return self.copies

    def _reply(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([self.version]), self._flat(self.copies)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """Push this rank's gradients to every server; serve the others' gradients in their order of
        arrival; take each server's answer into the replica."""
        loss = closure() if closure is not None else None
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        remote = [s for s in range(self.servers) if s != self.rank and self.shares[s]]
        peer = lambda r: dist.get_global_rank(self.messages, r)  # noqa: E731
        pending, in_flight = [], []  # the tensors being sent stay referenced until their sends complete
        for s in remote:
            header, payload = torch.tensor([self.rank, self.versions[s]]), self._flat([p.grad for p in self.shares[s]])
            in_flight += [header, payload]
            pending += [dist.isend(header, peer(s), self.messages, PUSH_HEADER),
                        dist.isend(payload, peer(s), self.messages, PUSH_DATA)]
            self.counter.add(payload.numel() * payload.element_size() + 16, 1)
        if self.copies:
            self._serve(self.rank, self.versions[self.rank], self._flat([p.grad for p in self.shares[self.rank]]))
            self.versions[self.rank] = self.version
            self._unflatten(self._flat(self.copies).to(self.params[0].device), list(self.shares[self.rank]))
            for _ in range(self.world - 1):
                header = torch.empty(2, dtype=torch.int64)
                dist.recv(header, None, self.messages, PUSH_HEADER)
                worker, grad_version = int(header[0]), int(header[1])
                grads = torch.empty(sum(c.numel() for c in self.copies), dtype=self.copies[0].dtype)
                dist.recv(grads, peer(worker), self.messages, PUSH_DATA)
                self._serve(worker, grad_version, grads)
                version, values = self._reply()
                in_flight += [version, values]
                pending += [dist.isend(version, peer(worker), self.messages, REPLY_HEADER),
                            dist.isend(values, peer(worker), self.messages, REPLY_DATA)]
                self.counter.add(values.numel() * values.element_size() + 8, 1)
                self.server_bytes += (grads.numel() + values.numel()) * values.element_size()
        for s in remote:
            version = torch.empty(1, dtype=torch.int64)
            values = torch.empty(sum(p.numel() for p in self.shares[s]), dtype=self.shares[s][0].dtype)
            dist.recv(version, peer(s), self.messages, REPLY_HEADER)
            dist.recv(values, peer(s), self.messages, REPLY_DATA)
            self.versions[s] = int(version)
            self._unflatten(values.to(self.params[0].device), list(self.shares[s]))
        for work in pending:
            work.wait()
        return loss

    def checkpoint_state(self) -> dict[str, Any]:
        """The versions this rank's replica holds and, on a server, its copy, optimiser state, version and
        hyper-parameters, keyed by parameter name: live tensors, which a load fills in place."""
        self._template: dict[str, Any] = {"versions": torch.tensor(self.versions)}
        if self.inner is None:
            return self._template
        self.inner_with_current_hyperparameters()
        if not self.inner.state:  # allocate the state a load fills: a step at learning rate 0 on zero gradients
            lrs = [g["lr"] for g in self.inner.param_groups]
            for g in self.inner.param_groups:
                g["lr"] = 0.0
            for c in self._with_grads():
                c.grad.zero_()
            self.inner.step()
            for g, lr in zip(self.inner.param_groups, lrs, strict=True):
                g["lr"] = lr
        self._template.update({
            "version": torch.tensor([self.version]),
            "lr": torch.tensor([float(g["lr"]) for g in self.inner.param_groups], dtype=torch.float64),
            "copies": dict(zip(self.names, self.copies, strict=True)),
            "state": {name: self.inner.state[c] for name, c in zip(self.names, self.copies, strict=True)}})
        return self._template

    def adopt_loaded_state(self) -> None:
        """After ``checkpoint_state``'s tensors were loaded in place: take the versions and learning rates."""
        loaded = self._template
        self.versions = [int(v) for v in loaded["versions"]]
        if self.inner is None:
            return
        self.version = int(loaded["version"][0])
        for g, source, lr in zip(self.inner.param_groups, self._sources, loaded["lr"].tolist(), strict=True):
            g["lr"] = source["lr"] = lr

    def saved_state(self, model: nn.Module) -> dict[str, Any]:
        """``checkpoint_state``: what a checkpoint holds of this rank."""
        return self.checkpoint_state()

    def state_template(self, model: nn.Module) -> dict[str, Any]:
        """``checkpoint_state``: live tensors, which a load fills in place."""
        return self.checkpoint_state()

    def load_saved_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Take the versions and learning rates loaded into ``state_template``'s tensors."""
        self.adopt_loaded_state()

    def write_log(self, directory: Path) -> None:
        """This server's log, one JSON object per gradient."""
        if self.copies:
            directory.mkdir(parents=True, exist_ok=True)
            with open(directory / f"server{self.rank}.jsonl", "w") as handle:
                handle.writelines(json.dumps(entry) + "\n" for entry in self.log)
