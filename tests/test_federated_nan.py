"""A federated round that leaves the global model non-finite is acted on as a non-finite step is: ``stop`` ends
the run at that round keeping the last good checkpoint, ``skip`` drops the round's update and counts it.

The non-finite rounds are made so by construction, not by a trajectory: a client that sends its update times
infinity (``attack.kind=scale``, ``attack.scale=inf``), and a BatchNorm running variance set negative, which
leaves every value of the model finite while its evaluation computes nan.
"""

from __future__ import annotations

import json
import math
import re
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from disttrain.checkpoint.export import consolidated_weights
from disttrain.checkpoint.io import load_metadata
from disttrain.fault.config import NON_FINITE_EXIT
from tests.conftest import ROOT, train_cli_in_process

CLIENTS, PER_ROUND, ROUNDS, HOSTILE = 10, 2, 6, 0.1
RUN = ["parallel=federated", f"federated.clients={CLIENTS}", f"federated.clients_per_round={PER_ROUND}",
       "federated.local_steps=2", "federated.batch_size=16", f"federated.rounds={ROUNDS}", "trainer.devices=2",
       "trainer.limit_val_batches=2", "trainer.run_test=false", "trainer.log_every_n_steps=1", "logger=csv",
       "callbacks=none", "checkpoint.every_n_train_steps=1", "checkpoint.keep_last=20"]
INFINITE_CLIENT = ["federated.attack.kind=scale", "federated.attack.scale=inf", f"federated.attack.fraction={HOSTILE}"]


def attacked_rounds(seed: int = 0) -> list[int]:
    """The rounds (from 1) that draw the hostile client, from the seed's draws alone (no training)."""
    from disttrain.federated import attack
    from disttrain.federated.config import FederatedConfig
    from disttrain.federated.rounds import FederatedRounds

    hostile = attack.attackers(HOSTILE, CLIENTS, seed)
    view = SimpleNamespace(cfg=FederatedConfig(clients=CLIENTS, clients_per_round=PER_ROUND),
                           eligible=torch.arange(CLIENTS), seed=seed)  # iid: every client holds samples
    return [r + 1 for r in range(ROUNDS) if hostile & set(FederatedRounds.drawn(view, r))]


def _run(args: list[str], run_dir) -> Any:
    return train_cli_in_process([*RUN, *args, f"hydra.run.dir={run_dir}"], ROOT)


def _weights(run_dir, step: int) -> dict[str, torch.Tensor]:
    """The global model after ``step`` rounds (the newest save point is ``last.ckpt``)."""
    name = "last.ckpt" if step == ROUNDS else f"last-step{step}.ckpt"
    return consolidated_weights(run_dir / "checkpoints" / name)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def _finite(weights: dict[str, torch.Tensor]) -> bool:
    return all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point())


class NegativeVarianceAfterRound(pl.Callback):
    """After round ``round`` (on every rank alike), every BatchNorm running variance is set to -1: the model's
    values stay finite, and its evaluation computes nan (as a mean over sign-flipped updates can leave it)."""

    def __init__(self, round: int) -> None:
        self.round = round

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if trainer.global_step == self.round:
            for module in pl_module.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    module.running_var.fill_(-1.0)


def _negative_variance_after(round_number: int) -> list[str]:
    return [f"+callbacks.bn._target_={__name__}.NegativeVarianceAfterRound", f"+callbacks.bn.round={round_number}"]


def test_stop_ends_the_run_at_the_first_round_whose_global_model_is_not_finite(tmp_path):
    bad = attacked_rounds()[0]
    assert bad >= 2  # a good round, and its checkpoint, come first
    run_dir = tmp_path / "run"
    done = _run(INFINITE_CLIENT, run_dir)
    assert done.returncode == NON_FINITE_EXIT, done.stderr[-3000:]
    last = run_dir / "checkpoints" / "last.ckpt"
    said = re.search(rf"Error: the global model after round {bad} is (-?inf|nan) at step {bad}: the run stops, "
                     rf"keeping its last good checkpoint \(step {bad - 1}, {re.escape(str(last))}\)", done.stderr)
    assert said, done.stderr[-3000:]
    assert load_metadata(last)["global_step"] == bad - 1 and _finite(consolidated_weights(last))
    assert not (run_dir / "checkpoints" / f"last-step{bad}.ckpt").exists()


def test_skip_drops_each_non_finite_round_and_keeps_the_server_moments(tmp_path):
    bad = attacked_rounds()
    assert bad and bad[-1] < ROUNDS  # a round after the last dropped one shows that training goes on
    run_dir = tmp_path / "run"
    # FedAdam: moments that took an infinite update would make every later model non-finite (and skipped)
    done = _run([*INFINITE_CLIENT, "fault_tolerance.nan_policy=skip", "federated.strategy=fedadam"], run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["fault_tolerance"]["skipped_steps"] == len(bad)
    assert f"warning: {len(bad)} of {ROUNDS} optimiser steps were skipped for non-finite numbers" in done.stderr
    history = results["federated"]["history"]
    assert [row["round"] for row in history if row.get("skipped")] == bad
    for r in bad:  # the dropped round left the global model as the round before it had
        assert _same(_weights(run_dir, r - 1), _weights(run_dir, r)) if r > 1 else True
    after = _weights(run_dir, ROUNDS)
    assert _finite(after) and not _same(after, _weights(run_dir, bad[-1]))
    assert all(math.isfinite(row["val/loss"]) for row in history)


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_finite_model_whose_validation_loss_is_not_is_acted_on(tmp_path, policy):
    bad = 3
    run_dir = tmp_path / "run"
    done = _run([*_negative_variance_after(bad), f"fault_tolerance.nan_policy={policy}"], run_dir)
    if policy == "stop":
        assert done.returncode == NON_FINITE_EXIT, done.stderr[-3000:]
        last = run_dir / "checkpoints" / "last.ckpt"
        assert (f"Error: the validation loss after round {bad} is nan at step {bad}: the run stops, keeping its "
                f"last good checkpoint (step {bad - 1}, {last})") in done.stderr, done.stderr[-3000:]
        assert load_metadata(last)["global_step"] == bad - 1
        return
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["fault_tolerance"]["skipped_steps"] == 1
    history = results["federated"]["history"]
    assert [row["round"] for row in history if row.get("skipped")] == [bad]
    assert math.isnan(history[bad - 1]["val/loss"])
    assert all(math.isfinite(row["val/loss"]) for row in history[bad:])  # the round's model was put back
    assert _same(_weights(run_dir, bad - 1), _weights(run_dir, bad))


def test_skip_drops_rounds_whose_clients_training_loss_is_not_finite(tmp_path):
    # an infinite local learning rate makes each client's weights infinite after its first step, and its second
    # step's loss nan: every round is dropped, and the global model stays as it started
    run_dir = tmp_path / "run"
    done = _run(["fault_tolerance.nan_policy=skip", "optim.lr=inf"], run_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((run_dir / "results.json").read_text())
    assert results["fault_tolerance"]["skipped_steps"] == ROUNDS
    assert all(row.get("skipped") and math.isnan(row["train_loss"]) for row in results["federated"]["history"])
    assert _same(_weights(run_dir, 1), _weights(run_dir, ROUNDS)) and _finite(_weights(run_dir, ROUNDS))
