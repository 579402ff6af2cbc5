"""Pipeline parallelism through the real runner: accumulation and 3-D layouts match one process; save and resume.

Every schedule, pp x dp_shard and pp x tp are in ``test_parity.py``."""

from __future__ import annotations

import json

import pytest
import torch

from disttrain.launch.job import train
from tests.conftest import single_process_curve
from tests.test_run import GPT_FAST, step_losses
from tests.test_tp_run import assert_close_curves

# 4 blocks so that interleaved schedules get 2 stages per rank on 2 ranks; untied head (see pipeline.yaml); six
# steps: a stage's gradient or step lost moves the first update, which the second step's loss shows
PIPE_MODEL = ["model.n_layer=4", "model.tie_weights=false", "trainer.max_steps=6"]


@pytest.fixture(scope="module")
def single_curve(tmp_path_factory):
    return single_process_curve(tmp_path_factory, [*GPT_FAST, *PIPE_MODEL])


def test_pipeline_with_sharded_data_parallel_and_accumulation(make_config, tmp_path, single_curve):
    overrides = [*GPT_FAST, *PIPE_MODEL, "parallel=pipeline", "parallel.pp=2", "parallel.dp_shard=2",
                 "parallel.zero_stage=3", "trainer.devices=4", "batch.accumulation=2",
                 "parallel.pipeline.microbatches=2"]
    train(make_config(overrides, tmp_path / "run"))
    # under manual optimisation Lightning writes a row per batch, repeating the step's loss on the batch
    # that only accumulated; keep one value per optimiser step
    rows = step_losses(tmp_path / "run")
    per_step = [loss for i, loss in enumerate(rows) if i == 0 or loss != rows[i - 1]]
    assert_close_curves(single_curve, per_step)


def test_pipeline_x_sharded_data_parallel_x_tensor_parallel(make_config, tmp_path, single_curve):
    overrides = [*GPT_FAST, *PIPE_MODEL, "parallel=pipeline", "parallel.pp=2", "parallel.dp_shard=2",
                 "parallel.zero_stage=3", "parallel.tp=2", "trainer.devices=8", "parallel.pipeline.microbatches=2"]
    train(make_config(overrides, tmp_path / "run"))
    assert_close_curves(single_curve, step_losses(tmp_path / "run"))


def test_pipeline_save_and_resume_continue_the_curve(make_config, tmp_path):
    every3 = [*GPT_FAST, *PIPE_MODEL, "parallel=pipeline", "trainer.devices=2", "trainer.val_check_interval=3",
              "trainer.check_val_every_n_epoch=null", "checkpoint.save_top_k=-1"]
    train(make_config(every3, tmp_path / "straight"))
    step3 = tmp_path / "straight" / "checkpoints" / "step3.ckpt"
    train(make_config([*every3, f"resume={step3}"], tmp_path / "resumed"))
    assert_close_curves(step_losses(tmp_path / "straight")[3:], step_losses(tmp_path / "resumed"))


def test_cnn_stages_chain_to_the_whole_model():
    from disttrain.data import build_datamodule
    from disttrain.data.digits import DigitsConfig
    from disttrain.models import build_model
    from disttrain.models.cnn import CNNConfig
    from disttrain.parallel.model_plan import pipeline_units_of
    from disttrain.parallel.pipeline.split import build_stage_module, unit_split_points

    model = build_model(CNNConfig(blocks_per_stage=2), build_datamodule(DigitsConfig(), 4, 0).spec).eval()
    units = pipeline_units_of(model)
    points = unit_split_points(model, units, 2)
    assert points == [0, 4]  # stem and the 32-channel blocks | the 64-channel blocks (3/4 of the weights) and head
    first, last = (build_stage_module(model, units, i, points) for i in (0, 1))
    images = torch.randn(4, 1, 8, 8)
    torch.testing.assert_close(last(first(images)), model(images), rtol=0, atol=0)
    names = {n for stage in (first, last) for n, _ in stage.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()}


def test_cnn_pipeline_trains_and_resumes(make_config, tmp_path):
    # BatchNorm statistics are per microbatch in a pipeline, so the curve is not compared with one process;
    # the resumed run must continue the uninterrupted curve step by step
    base = ["parallel=pipeline", "trainer.devices=2", "trainer.max_epochs=2", "logger=csv", "callbacks=none",
            "trainer.run_test=false", "trainer.log_every_n_steps=1", "checkpoint.save_top_k=-1"]
    train(make_config(base, tmp_path / "run"))
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["metrics"]["val/acc"] > 0.7, results["metrics"]
    straight = step_losses(tmp_path / "run")
    first_epoch = tmp_path / "run" / "checkpoints" / "step19.ckpt"
    train(make_config([*base, f"resume={first_epoch}"], tmp_path / "resumed"))
    resumed = json.loads((tmp_path / "resumed" / "results.json").read_text())
    assert resumed["global_steps"] == results["global_steps"] == 38
    assert_close_curves(straight[19:], step_losses(tmp_path / "resumed"))
    assert resumed["metrics"]["val/acc"] == pytest.approx(results["metrics"]["val/acc"], abs=1e-6)
