"""A callback for the torchft tests: after each step a group commits, its rank 0 records the step, its process id
and a digest of its weights and optimiser state; one group signals itself at a given step of its first start."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor

DIGESTS = "digests.jsonl"
"""In the run's log folder: one line per committed step and group rank."""


def state_digest(module: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> str:
    """SHA-256 of this rank's weights and optimiser state tensors, in order: equal digests are bitwise equal."""
    sha = hashlib.sha256()

    def add(value: Any) -> None:
        if isinstance(value, DTensor):
            value = value.to_local()
        if isinstance(value, torch.Tensor):
            sha.update(value.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())

    for value in module.state_dict().values():
        add(value)
    for optimizer in optimizers:
        for entry in optimizer.state.values():
            for key in sorted(entry):
                add(entry[key])
    return sha.hexdigest()[:16]


class StepDigests(pl.Callback):
    """Records every committed step; group ``group`` sends itself ``signum`` after ``step`` committed steps in its
    first start (0: never), with ``mid_step`` during the next step instead (after its backward, before the groups'
    exchange: the others then cannot commit that step), or with ``refuse`` reports an error to its Manager in that
    step instead, so that it alone does not commit it (as a transient error local to one group would); each step
    also sleeps ``sleep_s``, standing for a longer step's compute."""

    def __init__(self, group: int = -1, step: int = 0, signum: int = 0, sleep_s: float = 0.0,
                 refuse: bool = False, mid_step: bool = False) -> None:
        self.group, self.step, self.signum, self.sleep_s, self.refuse = group, step, signum, sleep_s, refuse
        self.mid_step = mid_step
        self._last = -1
        self._refused = False

    def _signals_now(self, step: int) -> bool:
        """Whether this rank sends itself ``signum`` at ``step`` committed steps."""
        group = int(os.environ.get("DISTTRAIN_REPLICA_GROUP", "0"))
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        return bool(group == self.group and attempt == 0 and step == self.step and self.signum)

    def on_after_backward(self, trainer: pl.Trainer, *_: Any) -> None:
        if self.mid_step and self._signals_now(trainer.global_step):
            os.kill(os.getpid(), self.signum)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """With ``refuse``: the group's vote on step ``step + 1`` carries an error, after the step's all-reduce (an
        error before it would fail the exchange, and so the step, in every group)."""
        group = int(os.environ.get("DISTTRAIN_REPLICA_GROUP", "0"))
        if not self.refuse or group != self.group:
            return
        steps = pl_module.steps
        commit = steps.commit

        def refusing(finite: bool) -> bool:
            if not self._refused and trainer.global_step == self.step:
                self._refused = True
                steps.manager.report_error(RuntimeError("an error of this group alone"))
            return commit(finite)

        steps.commit = refusing

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        step = trainer.global_step
        if step == self._last:
            return  # an accumulation micro-batch, or a step not committed
        self._last = step
        group = int(os.environ.get("DISTTRAIN_REPLICA_GROUP", "0"))
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        row = {"group": group, "rank": trainer.global_rank, "attempt": attempt, "pid": os.getpid(), "step": step,
               "digest": state_digest(trainer.lightning_module, trainer.optimizers), "time": time.time()}
        with open(Path(trainer.default_root_dir) / "logs" / DIGESTS, "a") as out:
            out.write(json.dumps(row) + "\n")
        if self.sleep_s:
            time.sleep(self.sleep_s)
        if not self.mid_step and self._signals_now(step):
            os.kill(os.getpid(), self.signum)
