"""Whole federated runs through the runner: FedAvg equals Local SGD, a killed run resumes bitwise, accuracy
against centralised training, and a Flower ClientApp training as the simulated client."""

from __future__ import annotations

import json

import pytest
import torch

# ---- whole runs ---------------------------------------------------------------------------------------------

K, R, B = 3, 4, 16
# plain SGD (no momentum: clients start each round with a fresh optimiser, replicas keep theirs) with weight
# decay and a clipping bound that binds, so a wrong gradient scale or norm changes every weight
SHARED = ["trainer.devices=2", "trainer.log_every_n_steps=1", "trainer.run_test=false", "logger=csv", "callbacks=none",
          "optim=sgd", "optim.lr=0.05", "optim.momentum=0.0", "optim.nesterov=false", "optim.weight_decay=0.01",
          "scheduler=cosine", "scheduler.name=constant", "trainer.gradient_clip_val=0.3"]


def _train(overrides: list[str], run_dir) -> dict:
    from disttrain.launch.job import train
    from tests.conftest import compose_config

    train(compose_config([*SHARED, *overrides], run_dir))
    return json.loads((run_dir / "results.json").read_text())


def test_fedavg_with_every_iid_client_each_round_is_local_sgd(tmp_path):
    from disttrain.checkpoint.export import consolidated_weights
    from tests.test_run import step_losses

    _train(["parallel=localsgd", f"parallel.sync_every={K}", f"trainer.max_steps={R * K}",
            f"batch.global_size={2 * B}"], tmp_path / "local")
    results = _train(["parallel=federated", "federated.clients=2", "federated.clients_per_round=0",
                      f"federated.local_steps={K}", f"federated.rounds={R}", f"federated.batch_size={B}"],
                     tmp_path / "fed")
    assert results["federated"]["rounds"] == R
    local = step_losses(tmp_path / "local")
    per_round = [sum(local[r * K:(r + 1) * K]) / K for r in range(R)]
    assert step_losses(tmp_path / "fed") == pytest.approx(per_round, rel=1e-6)  # measured: 1.5e-7
    ours = consolidated_weights(tmp_path / "fed" / "checkpoints" / "last.ckpt")
    theirs = consolidated_weights(tmp_path / "local" / "checkpoints" / "last.ckpt")
    params = [name for name in ours if "running_" not in name and "num_batches" not in name]
    assert len(params) > 10
    for name in params:  # BatchNorm statistics differ: Local SGD keeps rank 0's, FedAvg averages them
        assert torch.allclose(ours[name], theirs[name], rtol=1e-6, atol=1e-6), name


def test_a_killed_federated_run_resumes_at_a_round_boundary_bitwise(tmp_path):
    from tests.fault_runs import STEPS, assert_killed_run_restarts_bitwise

    # GPT on text, dropout on: rounds 5 and 6 are lost with the killed rank and run again from round 4's save
    assert_killed_run_restarts_bitwise(["parallel=federated", "federated.clients=4", "federated.clients_per_round=3",
                                        "federated.local_steps=2", "federated.batch_size=4",
                                        f"federated.rounds={STEPS}", "trainer.max_steps=-1",
                                        "federated.strategy=fedadam"], 1, tmp_path)


# 64 s on a busy 2-core machine (2250 CNN steps); that FedAvg trains as it should is checked fast: exactly local SGD
# above, and above 0.9 test accuracy in 15 rounds in test_federated_robust.py's clean run
@pytest.mark.slow
def test_iid_fedavg_reaches_centralised_accuracy_within_two_points_in_30_rounds(tmp_path):
    from disttrain.launch.job import train
    from tests.conftest import compose_config

    common = ["trainer.devices=1", "logger=csv", "callbacks=none"]
    # centralised: the default digits run for as many samples as 30 rounds of 5 clients x 10 steps x 32
    train(compose_config([*common, "trainer.max_steps=750"], tmp_path / "central"))
    train(compose_config([*common, "parallel=federated", "trainer.val_check_interval=10", "plots=true"],
                          tmp_path / "fed"))
    central, fed = (json.loads((tmp_path / run / "results.json").read_text()) for run in ("central", "fed"))
    assert fed["federated"]["rounds"] == 30 and fed["federated"]["clients_per_round"] == 5
    # measured: 0.9916 federated, 0.9944 centralised
    assert fed["metrics"]["test/acc"] >= central["metrics"]["test/acc"] - 0.02
    assert (tmp_path / "fed" / "plots" / "federated_accuracy.png").is_file()


def test_a_flower_client_app_trains_exactly_as_the_simulated_client(tmp_path, make_config, monkeypatch):
    pytest.importorskip("flwr")
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
    from flwr.serverapp.strategy import FedProx
    from flwr.supercore.task_identity import TaskIdentity
    from omegaconf import OmegaConf

    from disttrain.launch.flower import FlowerClient, client_app, flower_strategy, load_run

    config_path = tmp_path / "config.yaml"
    cfg = make_config(["parallel=federated", "trainer.devices=1", "federated.partition=dirichlet",
                       "federated.strategy=fedprox", "federated.mu=0.1", "federated.local_steps=3"])
    config_path.write_text(OmegaConf.to_yaml(cfg))
    run = load_run(config_path)
    assert isinstance(flower_strategy(run.train.federated), FedProx)
    reference = FlowerClient(run)
    start = {k: v.clone() for k, v in reference.rounds.net.state_dict().items()}
    expected, weight, _ = reference.train(start, server_round=2, client=7)
    assert weight == pytest.approx(len(reference.rounds.data[7]))
    for name in ("_run_id", "_node_id", "_task_id"):  # what Flower's runtime sets in a node's process
        monkeypatch.setattr(TaskIdentity, name, 1, raising=False)
    message = Message(content=RecordDict({"arrays": ArrayRecord(start), "config": ConfigRecord({"server-round": 2})}),
                      dst_node_id=7, message_type="train")
    context = Context(run_id=1, node_id=7, node_config={"partition-id": 7, "num-partitions": 20}, state=RecordDict(),
                      run_config={})
    reply = client_app(config_path)(message, context)
    trained = reply.content["arrays"].to_torch_state_dict()
    assert reply.content["metrics"]["num-examples"] == pytest.approx(weight)
    for name, value in expected.items():
        assert torch.equal(trained[name], value), name
    assert any(not torch.equal(start[name], value) for name, value in expected.items())
