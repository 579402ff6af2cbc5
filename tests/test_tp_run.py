"""Tensor parallelism through the real runner: loss curves match one process; save and resume continue."""

from __future__ import annotations

import pytest

from disttrain.launch.job import train
from tests.conftest import single_process_curve
from tests.test_run import GPT_FAST, step_losses

REL = 1e-6  # relative loss tolerance of the model-parallel parity tests (AdamW, tied head)


def assert_close_curves(reference: list[float], other: list[float]) -> None:
    assert len(reference) == len(other) > 0
    for step, (x, y) in enumerate(zip(reference, other, strict=True)):
        assert abs(x - y) <= REL * abs(x), f"step {step}: {x} vs {y}"


TEN_STEPS = [*GPT_FAST, "trainer.max_steps=10"]


@pytest.fixture(scope="module")
def single_curve(tmp_path_factory):
    return single_process_curve(tmp_path_factory, TEN_STEPS)


@pytest.mark.parametrize(
    ("overrides", "ranks"),
    [
        (["parallel=tp"], 2),
        (["parallel=tp", "parallel.sequence_parallel=true"], 2),
        (["parallel=hybrid", "parallel.tp=2"], 4),
    ],
    ids=["tp2", "tp2-sequence-parallel", "dp_shard2-x-tp2"],
)
def test_tensor_parallel_matches_single_process(make_config, tmp_path, single_curve, overrides, ranks):
    train(make_config([*TEN_STEPS, *overrides, f"trainer.devices={ranks}"], tmp_path / "run"))
    assert_close_curves(single_curve, step_losses(tmp_path / "run"))


def test_tensor_parallel_save_and_resume_continue_the_curve(make_config, tmp_path):
    every5 = [*TEN_STEPS, "parallel=tp", "trainer.devices=2", "trainer.val_check_interval=5",
              "trainer.check_val_every_n_epoch=null", "checkpoint.save_top_k=-1"]
    train(make_config(every5, tmp_path / "straight"))
    step5 = tmp_path / "straight" / "checkpoints" / "step5.ckpt"
    train(make_config([*every5, f"resume={step5}"], tmp_path / "resumed"))
    assert_close_curves(step_losses(tmp_path / "straight")[5:], step_losses(tmp_path / "resumed"))
