"""The parameter server. Synchronous: averaged-gradient training through point-to-point messages, so it equals
DDP bit for bit when both add in rank order (with clipping that binds on the averaged gradients), its servers'
traffic falls with their number, and a killed run restarts bitwise with each server's optimiser state.
Asynchronous: no applied update is more than ``staleness`` versions late (from the servers' logs), and a
restart resumes the servers' versions."""

from __future__ import annotations

import json
import signal

import pytest
import torch

from disttrain.parallel.param_server import owners

STEPS = 30
# SGD with clipping that binds: a wrong average (a sum, a missing worker) or clipping local gradients moves it
RUN = ["trainer.max_steps=30", "trainer.log_every_n_steps=1", "trainer.run_test=false", "logger=csv",
       "callbacks=none", "optim=sgd", "optim.lr=0.05", "optim.momentum=0.9", "trainer.gradient_clip_val=0.5"]


def _run(overrides: list[str], run_dir) -> dict:
    from disttrain.launch.job import train
    from tests.conftest import compose_config

    train(compose_config([*RUN, *overrides], run_dir))
    return json.loads((run_dir / "results.json").read_text())


@pytest.fixture(scope="module")
def ddp_four(tmp_path_factory):
    """DDP on 4 ranks, its all-reduce replaced by a mean that adds the ranks' gradients in rank order as the
    servers do: gloo's ring adds every chunk in its own order, and the rounding differences it leaves grow in
    training by a factor that depends on the CPU (to 2e-5 of the loss in 30 steps on some)."""
    run_dir = tmp_path_factory.mktemp("ddp4")
    _run(["parallel=ddp", "trainer.devices=4", "+callbacks.order._target_=tests.rank_order.RankOrderMean"], run_dir)
    return run_dir


def cnn_numels() -> list[int]:
    from disttrain.models.cnn import CNN, CNNConfig

    return [p.numel() for p in CNN(1, 10, CNNConfig().widths).parameters()]


@pytest.mark.parametrize("servers", [1, 2])
def test_a_synchronous_parameter_server_is_ddp_and_its_servers_share_the_traffic(ddp_four, tmp_path, servers):
    from disttrain.checkpoint.export import consolidated_weights
    from tests.test_run import step_losses

    results = _run(["parallel=param_server", f"parallel.servers={servers}", "trainer.devices=4"], tmp_path / "ps")
    # the same additions in the same order on every CPU: equal bit for bit, losses and weights
    assert step_losses(tmp_path / "ps") == step_losses(ddp_four)
    mine = consolidated_weights(tmp_path / "ps" / "checkpoints" / "last.ckpt")
    ddp = consolidated_weights(ddp_four / "checkpoints" / "last.ckpt")
    for name in mine:
        assert torch.equal(mine[name], ddp[name]), name
    # a server receives the gradients of its parameters from the 3 other ranks and sends the parameters back
    numels = cnn_numels()
    load = [sum(n for n, o in zip(numels, owners([torch.empty(n) for n in numels], servers), strict=True) if o == s)
            for s in range(servers)]
    assert results["param_server"]["busiest_server_bytes_per_step"] == 2 * 3 * max(load) * 4
    assert max(load) <= sum(numels) / servers * 1.05  # whole tensors, balanced to 5%: S servers, 1/S the traffic


SHAPES = [(40, 3), (64,), (5, 5), (7,), (3,), (9, 2), (11,), (4, 4), (13,), (6,), (2, 5), (17,)]


def _rank_gradients(draw: int, rank: int) -> list[torch.Tensor]:
    """Gradients whose magnitudes span six decades, so that every order of addition rounds differently."""
    generator = torch.Generator().manual_seed(1000 * draw + rank)
    return [torch.randn(shape, generator=generator) * 10.0 ** torch.randint(-3, 4, shape, generator=generator)
            for shape in SHAPES]


def _initial_parameters() -> list[torch.nn.Parameter]:
    """Zeros: a step of SGD at learning rate 1 makes them minus the clipped gradients, every rounding kept."""
    return [torch.nn.Parameter(torch.zeros(shape)) for shape in SHAPES]


def _steps_with_three_servers(draws: int) -> list[tuple[list[torch.Tensor], torch.Tensor, list[torch.Tensor],
                                                        torch.Tensor]]:
    """Per draw of gradients: the weights and norm of one step of 3 servers, and of the reference."""
    import torch.distributed as dist

    from disttrain.comm.counter import ByteCounter
    from disttrain.parallel.clip import clip_grad_norm
    from disttrain.parallel.param_server import ParameterServerOptimizer

    world, steps = dist.get_world_size(), []
    for draw in range(draws):
        params = _initial_parameters()
        for param, grad in zip(params, _rank_gradients(draw, dist.get_rank()), strict=True):
            param.grad = grad
        server = ParameterServerOptimizer(torch.optim.SGD(params, lr=1.0), dist.group.WORLD, 3, ByteCounter())
        server.clip_value = 0.5
        server.step()
        # one process holding every rank's gradients: added in rank order, clipped and stepped as DDP's task does
        reference, grads = _initial_parameters(), [_rank_gradients(draw, rank) for rank in range(world)]
        for index, param in enumerate(reference):
            param.grad = grads[0][index].clone()
            for rank in range(1, world):
                param.grad += grads[rank][index]
            param.grad /= world
        norm = clip_grad_norm(reference, 0.5)
        torch.optim.SGD(reference, lr=1.0).step()
        steps.append(([p.detach() for p in params], server.last_norm, [p.detach() for p in reference], norm))
    return steps


def test_every_server_adds_in_rank_order_and_the_norm_in_parameter_order():
    from tests.dist_utils import run_on_ranks

    # 3 servers of 4 ranks: a server that added its own gradient first, or a norm added up server by server,
    # would round differently from the rank-order mean (in some of the draws: a rounding may come out alike)
    for steps in run_on_ranks(_steps_with_three_servers, 4, 32):
        for params, norm, reference, reference_norm in steps:
            assert torch.equal(norm, reference_norm) and norm > 0.5  # the clipping binds
            assert all(torch.equal(ours, theirs) for ours, theirs in zip(params, reference, strict=True))


def test_a_killed_parameter_server_run_restarts_bitwise(tmp_path):
    from tests.fault_runs import assert_killed_run_restarts_bitwise

    # AdamW state lives on the servers only; 2 servers of 2 ranks: each holds part of it; rank 0 (a server) dies
    assert_killed_run_restarts_bitwise(["parallel=param_server", "parallel.servers=2"], 0, tmp_path)


def test_bad_parameter_server_settings_are_refused(tmp_path):
    from disttrain.config import validate
    from disttrain.errors import ConfigError
    from tests.conftest import compose_config

    for overrides, message in ((["parallel=param_server", "parallel.servers=3"], "at most the 2 ranks"),
                               (["parallel=param_server", "comm=fp16"], "none with a parameter server"),
                               (["parallel=param_server", "parallel.sync_every=4"], "0 with parallel.sync_every"),
                               (["parallel=zero2", "parallel.servers=1"], "parallel.servers=1 is invalid: 0 unless"),
                               (["parallel=ddp", "parallel.staleness=2"], "0 unless parallel.servers > 0")):
        with pytest.raises(ConfigError, match=message):
            validate(compose_config(["trainer.devices=2", *overrides], tmp_path / "run"))


def _server_logs(run_dir) -> list[dict]:
    return [json.loads(line) for path in sorted((run_dir / "logs").glob("server*.jsonl"))
            for line in path.read_text().splitlines()]


def test_asynchronous_updates_are_never_more_than_s_versions_late(tmp_path, capfd):
    from tests.test_run import step_losses

    # 4 workers meet once per step, so the last of them to reach a server is up to 3 versions late: with
    # staleness 1 some gradients must be dropped
    results = _run(["parallel=param_server", "parallel.servers=2", "parallel.staleness=1", "trainer.devices=4",
                    "trainer.max_steps=20"], tmp_path / "async")
    log = _server_logs(tmp_path / "async")
    assert len(log) == 2 * 4 * 20  # every gradient of every worker reached both servers
    late = [entry["server_version"] - entry["grad_version"] for entry in log]
    assert all(lag <= 1 for lag, entry in zip(late, log, strict=True) if entry["applied"])
    assert any(lag > 1 and not entry["applied"] for lag, entry in zip(late, log, strict=True))
    server = results["param_server"]
    assert server["most_versions_late"] <= 1
    assert server["applied_updates"] == sum(e["applied"] for e in log)
    assert server["dropped_updates"] == sum(not e["applied"] for e in log) > 0
    summary = capfd.readouterr().out  # the run's last lines say what the exchange did
    assert f"exchange: {results['comm']['bytes_sent_per_step']:,} bytes per rank and step" in summary
    assert f"{server['dropped_updates']:,} of {len(log):,} gradients dropped as more than 1 version(s) late" in summary
    losses = step_losses(tmp_path / "async")
    assert sum(losses[-5:]) < sum(losses[:5])  # it trains


def test_a_killed_asynchronous_run_resumes_the_servers_versions_and_state(tmp_path):
    from tests.fault_runs import KILL_AT, run, signal_at

    # saves at steps 4 and 8; 2 workers, 1 server and staleness 1: nothing is dropped, 2 updates per step
    done = run(["parallel=param_server", "parallel.staleness=1", "fault_tolerance.max_restarts=1",
                *signal_at(KILL_AT, 1, signal.SIGKILL)], tmp_path / "killed")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "restarting all 2 ranks" in done.stderr
    log = _server_logs(tmp_path / "killed")  # written by the restarted ranks: from step 5 on
    assert log[0]["server_version"] == 2 * 4  # the version saved at step 4, not a fresh server's 0
    assert len(log) == 2 * (12 - 4) and all(entry["applied"] for entry in log)
