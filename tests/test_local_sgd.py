"""Local SGD and DiLoCo: replicas that meet every H steps. H = 1 is DDP, T steps meet ceil(T / H) times, the
outer step is the closed form of SGD with Nesterov momentum, and a killed DiLoCo run restarts bitwise."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist

from disttrain.comm.counter import ByteCounter
from disttrain.parallel.config import OuterOptions
from disttrain.parallel.local_sgd import OuterSteps
from tests.dist_utils import run_on_ranks

STEPS = 30
# SGD with momentum and weight decay is linear in the gradient, so averaging the replicas after every step is
# averaging their gradients; clipping is not (each replica clips its own gradient), so it is off here, and a
# wrong average (a sum, or one rank's copy) would still move every weight.
RUN = ["trainer.devices=2", f"trainer.max_steps={STEPS}", "trainer.log_every_n_steps=1", "trainer.run_test=false",
       "logger=csv", "callbacks=none", "optim=sgd", "optim.lr=0.05", "optim.momentum=0.9", "optim.weight_decay=0.01",
       "trainer.gradient_clip_val=null"]


def _run(overrides: list[str], run_dir) -> dict:
    from disttrain.launch.job import train
    from tests.conftest import compose_config

    train(compose_config([*RUN, *overrides], run_dir))
    return json.loads((run_dir / "results.json").read_text())


def test_local_sgd_meeting_every_step_is_ddp(tmp_path):
    from disttrain.checkpoint.export import consolidated_weights
    from tests.test_run import step_losses

    _run(["parallel=ddp"], tmp_path / "ddp")
    results = _run(["parallel=localsgd", "parallel.sync_every=1"], tmp_path / "local")
    assert results["outer_steps"] == {"sync_every": 1, "count": STEPS}
    ours, theirs = step_losses(tmp_path / "local"), step_losses(tmp_path / "ddp")
    assert ours == pytest.approx(theirs, rel=1e-6, abs=1e-6)  # measured: 1.1e-7 relative; weights 8.3e-7
    mine = consolidated_weights(tmp_path / "local" / "checkpoints" / "last.ckpt")
    ddp = consolidated_weights(tmp_path / "ddp" / "checkpoints" / "last.ckpt")
    assert mine.keys() == ddp.keys()
    for name in mine:
        assert torch.allclose(mine[name], ddp[name], rtol=1e-6, atol=1e-6), name


@pytest.mark.parametrize("every", [7, 10])
def test_t_steps_meet_ceil_t_over_h_times(tmp_path, every):
    results = _run(["parallel=localsgd", f"parallel.sync_every={every}"], tmp_path / "local")
    meetings = math.ceil(STEPS / every)  # after every H steps, and once more for the last 2 steps when H = 7
    assert results["outer_steps"]["count"] == meetings
    comm = results["comm"]
    assert comm["counted"]
    assert comm["bytes_sent_per_step"] == round(meetings * comm["fp32_allreduce_bytes_per_step"] / STEPS)


def _diloco_outer_steps() -> list[torch.Tensor]:
    """Two outer steps of DiLoCo on a 3-value model whose replicas drift by rank-dependent amounts."""
    net = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        net.weight.copy_(torch.tensor([[1.0, -2.0, 0.5]]))
    outer = OuterSteps(4, OuterOptions(lr=0.7, momentum=0.9, nesterov=True), ByteCounter())
    outer.start(net, dist.group.WORLD)
    seen = []
    for step in range(2):
        with torch.no_grad():
            net.weight.add_(torch.tensor([[0.1, 0.3, -0.2]]) * (dist.get_rank() + 1) * (step + 1))
        outer.outer_step()
        seen.append(net.weight.detach().clone())
    return seen


def test_the_diloco_outer_step_is_nesterov_sgd_on_the_mean_drift():
    world = 2
    by_rank = run_on_ranks(_diloco_outer_steps, world)
    glob, buffer = torch.tensor([[1.0, -2.0, 0.5]]), torch.zeros(1, 3)
    for step in range(2):
        replicas = [glob + torch.tensor([[0.1, 0.3, -0.2]]) * (r + 1) * (step + 1) for r in range(world)]
        drift = glob - sum(replicas) / world
        buffer = 0.9 * buffer + drift
        glob = glob - 0.7 * (drift + 0.9 * buffer)  # Nesterov: the gradient plus momentum times the new buffer
        for r in range(world):
            assert torch.allclose(by_rank[r][step], glob, rtol=1e-6, atol=1e-7), (step, r)


def test_a_killed_diloco_run_restarts_bitwise(tmp_path):
    from tests.fault_runs import assert_killed_run_restarts_bitwise

    # meetings every 3 steps and saves every 4: the save at step 4 holds replicas that differ, and each rank's
    # inner AdamW state; the kill at step 6 makes steps 5 and 6 run twice
    assert_killed_run_restarts_bitwise(["parallel=diloco", "parallel.sync_every=3"], 1, tmp_path)


def test_bad_local_sgd_settings_are_refused(tmp_path):
    from disttrain.config import validate
    from disttrain.errors import ConfigError
    from tests.conftest import compose_config

    for overrides, message in ((["parallel=zero3", "parallel.sync_every=4"], "parallel.sync_every=4 is invalid: 0 unl"),
                               (["parallel=localsgd", "comm=int8"], "replicas that meet in outer steps"),
                               (["parallel=diloco", "parallel.outer.momentum=0", ], "parallel.outer.nesterov"),
                               (["parallel=localsgd", "parallel.sync_every=-1"], "parallel.sync_every=-1")):
        with pytest.raises(ConfigError, match=message):
            validate(compose_config(["trainer.devices=2", *overrides], tmp_path / "run"))
