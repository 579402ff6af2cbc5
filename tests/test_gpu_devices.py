"""More GPU ranks than the machine shows: one line naming ``trainer.devices`` before any rank starts, checked here
on a CPU-only machine by making torch report GPUs (nothing touches a GPU: validation only counts them)."""

from __future__ import annotations

import pytest
import torch

from disttrain.config import validate
from disttrain.errors import ConfigError
from tests.conftest import train_cli_in_process

DDP2 = ["parallel=ddp", "trainer.devices=2"]


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)``: torch reports ``n`` CUDA devices (available when n > 0) for the rest of the test."""

    def show(count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)

    for name in ("WORLD_SIZE", "LOCAL_RANK"):  # not under a launcher, which places its ranks itself
        monkeypatch.delenv(name, raising=False)
    return show


def refusal(cfg) -> ConfigError:
    """The ConfigError that validating ``cfg`` raises, checked to be one line."""
    with pytest.raises(ConfigError) as info:
        validate(cfg)
    assert "\n" not in str(info.value)
    return info.value


@pytest.mark.parametrize("accelerator", ["auto", "gpu", "cuda"])
def test_more_ranks_than_gpus_is_one_line_naming_devices(make_config, gpus, accelerator):
    gpus(1)
    err = refusal(make_config([*DDP2, f"trainer.accelerator={accelerator}"]))
    assert (err.key, err.value) == ("trainer.devices", 2)
    assert str(err) == ("trainer.devices=2 is invalid: at most 1, as this machine shows 1 GPU (one per rank); "
                        "trainer.accelerator=cpu runs 2 CPU ranks")


def test_the_same_ranks_on_the_cpu_pass(make_config, gpus):
    gpus(1)
    run = validate(make_config([*DDP2, "trainer.accelerator=cpu"]))
    assert run.dims.world_size == 2


def test_as_many_ranks_as_gpus_pass_and_auto_takes_them_all(make_config, gpus):
    gpus(2)
    assert validate(make_config(DDP2)).dims.world_size == 2
    assert validate(make_config(["parallel=ddp", "trainer.devices=auto"])).dims.world_size == 2


def test_auto_on_a_preset_of_fixed_degrees_takes_that_many_gpus(make_config, gpus):
    gpus(4)
    assert validate(make_config(["trainer.devices=auto"])).dims.world_size == 1  # parallel=single
    assert validate(make_config(["parallel=zero3", "trainer.devices=auto"])).dims.world_size == 4


def test_a_range_is_named_as_written_and_its_largest_count_counts(make_config, gpus):
    gpus(2)
    elastic = ["parallel=ddp", "batch.global_size=8", "batch.micro_size=2"]
    err = refusal(make_config([*elastic, "trainer.devices=1:4"]))
    assert (err.key, err.value) == ("trainer.devices", "1:4")
    assert "MIN:MAX with MAX at most 2, as this machine shows 2 GPUs" in str(err)
    assert "trainer.accelerator=cpu runs 4 CPU ranks" in str(err)
    assert validate(make_config([*elastic, "trainer.devices=1:2"])).world_sizes == (2, 1)


def test_nodes_without_a_launcher_all_start_here(make_config, gpus):
    gpus(2)
    err = refusal(make_config([*DDP2, "trainer.num_nodes=2"]))
    assert "at most 2 ranks in all with trainer.num_nodes=2" in str(err)


def test_a_gpu_accelerator_without_gpus_names_the_accelerator(make_config, gpus):
    gpus(0)
    err = refusal(make_config(["trainer.accelerator=gpu"]))
    assert (err.key, err.value) == ("trainer.accelerator", "gpu")
    assert "cpu or auto: this machine shows no GPU" in str(err)


def test_a_launcher_places_its_ranks_itself(make_config, gpus, monkeypatch):
    gpus(1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert validate(make_config(DDP2)).dims.world_size == 2


def test_a_caller_naming_the_world_or_a_plan_is_not_refused(make_config, gpus):
    gpus(1)
    assert validate(make_config(DDP2), world_size=2).dims.world_size == 2  # e.g. loading a finished run
    assert validate(make_config([*DDP2, "mode=plan"])).dims.world_size == 2  # planning for a bigger machine


def test_the_command_prints_the_one_line_and_leaves_no_run_directory(tmp_path, gpus):
    gpus(1)
    proc = train_cli_in_process(DDP2, tmp_path)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.strip() == ("Error: trainer.devices=2 is invalid: at most 1, as this machine shows 1 GPU "
                                   "(one per rank); trainer.accelerator=cpu runs 2 CPU ranks")
    assert not list(tmp_path.iterdir())  # no run directory, no outputs/
