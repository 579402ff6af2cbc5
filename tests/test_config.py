"""Config validation: every bad input is a one-line ConfigError naming key, value and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from disttrain.config import BatchConfig, resolve_batch, validate
from disttrain.errors import ConfigError
from disttrain.launch.job import train
from disttrain.parallel.dims import ParallelDims
from tests.conftest import train_cli_in_process

ROOT = Path(__file__).resolve().parent.parent
GPT_TEXT = ["model=gpt", "data=pydocs"]
GPT_UNTIED = [*GPT_TEXT, "model.tie_weights=false"]


@pytest.mark.parametrize(
    ("overrides", "key", "allowed"),
    [
        (["optim.lr=-1"], "optim.lr", "positive"),
        (["batch.global_size=10", "batch.micro_size=4"], "batch.global_size", "multiple"),
        (["batch.global_size=64", "batch.micro_size=16", "batch.accumulation=2"], "batch.global_size", "equal"),
        (["data=tokens", "data.path=/no/such/dir"], "data.path", "train.bin"),
        (["model.name=resnet"], "model.name", "one of"),
        (["parallel=single", "trainer.devices=2"], "parallel", "world size is 2"),
        (["model=gpt", "data=pydocs", "model.n_embd=30", "model.n_head=4"], "model.n", "divisor"),
        (["resume=/no/such/last.ckpt"], "resume", "there is no such path"),
        (["trainer.precision=fp8"], "trainer.precision", "one of"),
        (["trainer.max_steps=0"], "trainer.max_steps", "positive"),
        (["trainer.rank_start=fork"], "trainer.rank_start", "one of ['auto', 'fork_server', 'interpreter']"),
        (["trainer.validate_before_training=true", "trainer.num_sanity_val_steps=2"], "trainer.num_sanity_val_steps",
         "0 with trainer.validate_before_training=true"),
        (["parallel.dp_replicate=-1", "parallel.dp_shard=-1"], "parallel.dp_shard", "at most one"),
        (["optim=sgd", "optim.momentum=0", "optim.nesterov=true"], "optim.nesterov", "momentum"),
        (["parallel=zero3", "trainer.devices=4", "parallel.dp_replicate=3"], "parallel", "does not divide"),
        (["parallel=zero3", "parallel.zero_stage=4", "trainer.devices=2"], "parallel.zero_stage", "one of 0, 1, 2, 3"),
        (["parallel=zero1", "trainer.devices=1"], "parallel.dp_shard", "> 1 (or parallel.cp > 1) for zero_stage=1"),
        (["parallel=ddp", "trainer.devices=2", "model.sync_batchnorm=true"], "model.sync_batchnorm", "GPU"),
        (["parallel=pipeline", "trainer.devices=8"], "parallel.pp", "8 stages for a model of 4 pipeline units"),
        (["parallel=pipeline", "trainer.devices=2", *GPT_TEXT], "parallel.pp", "untie it (model.tie_weights=false"),
        (["parallel=pipeline", "trainer.devices=2", *GPT_UNTIED, "parallel.pipeline.microbatches=1"],
         "parallel.pipeline.microbatches", "at least pp=2"),
        (["parallel=pipeline", "trainer.devices=2", *GPT_UNTIED, "parallel.pipeline.microbatches=3"],
         "parallel.pipeline.microbatches", "divisor of the batch size"),
        (["parallel=pipeline", "trainer.devices=8", *GPT_UNTIED], "parallel.pp", "at most one stage per unit"),
        (["parallel=pipeline", "trainer.devices=2", *GPT_UNTIED, "parallel.pipeline.schedule=looped"],
         "parallel.pipeline.schedule", "one of"),
        (["parallel=pipeline", "trainer.devices=2", *GPT_UNTIED, "parallel.pipeline.schedule=zbv"],
         "parallel.pipeline.stages_per_rank", "2 for the zbv"),
        (["parallel=pipeline", "trainer.devices=4", *GPT_UNTIED, "parallel.pp=2", "parallel.dp_replicate=2"],
         "parallel.pp", "not available yet"),
        (["parallel=tp", "trainer.devices=2"], "parallel.tp", "1 for model cnn: it declares no tp_plan()"),
        (["parallel=tp", "trainer.devices=2", "model=gpt", "data=pydocs", "model.n_head=1", "model.n_embd=33"],
         "model.n_head", "divisible by parallel.tp"),
        (["parallel=zero1", "trainer.devices=2", "parallel.cpu_offload=true"], "parallel.cpu_offload", "false"),
        (["parallel=zero3", "trainer.devices=2", "parallel.cpu_offload=true"], "parallel.cpu_offload", "CPU run"),
        (["parallel=ddp", "trainer.devices=2", "parallel.dp_replicate=4"], "parallel", "multiply to 4"),
        (["parallel=zero3", "trainer.devices=2", "parallel.accumulate_grads=whole"], "parallel.accumulate_grads",
         "auto, sharded or unsharded"),
        (["parallel=zero1", "trainer.devices=2", "parallel.accumulate_grads=sharded"], "parallel.accumulate_grads",
         "auto unless zero_stage is 2 or 3"),
        (["parallel=ddp", "trainer.devices=2", "parallel.accumulate_grads=unsharded"], "parallel.accumulate_grads",
         "got zero_stage=0"),
        (["parallel=pipeline", "trainer.devices=4", *GPT_UNTIED, "parallel.pp=2", "parallel.dp_shard=2",
          "parallel.zero_stage=3", "parallel.accumulate_grads=unsharded"], "parallel.accumulate_grads", "pp=2"),
        (["trainer.limit_val_batches=1.5"], "trainer.limit_val_batches", "a fraction in (0, 1]"),
        (["trainer.limit_test_batches=-1"], "trainer.limit_test_batches", "a count of batches >= 0"),
        (["trainer.val_check_interval=0"], "trainer.val_check_interval", "a count of batches >= 1"),
        (["trainer.val_check_interval=0.5", "trainer.check_val_every_n_epoch=null"], "trainer.val_check_interval",
         "an int) with trainer.check_val_every_n_epoch=null"),
        (["checkpoint.every_n_train_steps=5", "checkpoint.save_last=false"], "checkpoint.every_n_train_steps",
         "with checkpoint.save_last=true"),
        (["checkpoint.every_n_train_steps=0"], "checkpoint.every_n_train_steps", "a positive number of steps"),
        (["trainer.check_val_every_n_epoch=0"], "trainer.check_val_every_n_epoch", "a positive number of epochs"),
        (["trainer.limit_val_batches=all"], "trainer.limit_val_batches", "a count of batches (an int)"),
        (["parallel=pipeline", "trainer.devices=2", *GPT_UNTIED, "trainer.compile=true"], "trainer.compile",
         "pipeline"),
        (["trainer.compile=true", "trainer.compile_mode=fast"], "trainer.compile_mode",
         "one of default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs"),
        (["trainer.compile_mode=reduce-overhead"], "trainer.compile_mode", "default unless trainer.compile=true"),
        (["parallel=ddp", "trainer.devices=2", "trainer.compile=true", "trainer.compile_mode=reduce-overhead"],
         "trainer.compile_mode", "CUDA graphs replay no collectives"),
        (["parallel=zero3", "trainer.devices=1", "trainer.compile=true", "trainer.compile_mode=max-autotune"],
         "trainer.compile_mode", "under ZeRO"),
        (["trainer.compile=true", "trainer.compile_mode=reduce-overhead", "batch.micro_size=16"],
         "trainer.compile_mode", "with 4 micro-batches a step"),
        (["trainer.compile=true", "trainer.compile_scope=graph"], "trainer.compile_scope", "one of blocks, model"),
        (["trainer.compile_scope=model"], "trainer.compile_scope", "blocks unless trainer.compile=true"),
        (["parallel=zero3", "trainer.devices=1", "trainer.compile=true", "trainer.compile_scope=model"],
         "trainer.compile_scope", "blocks under this layout (single zero3)"),
    ],
)
def test_bad_input_is_one_clear_line(make_config, overrides, key, allowed):
    with pytest.raises(ConfigError) as info:
        validate(make_config(overrides))
    message = str(info.value)
    assert "\n" not in message
    assert info.value.key.startswith(key), message
    assert allowed in message, message


@pytest.mark.parametrize("override", ["+optim.lrr=0.1", "+model.depth=3", "trainer.devices=two", "model.widths=7"])
def test_misspelled_or_mistyped_keys_fail_while_composing(make_config, override):
    with pytest.raises(Exception) as info:  # noqa: B017 (Hydra's composition error, or ours for forced keys)
        validate(make_config([override]))
    assert override.lstrip("+").split("=")[0] in str(info.value)


def test_unknown_key_in_a_config_file_is_named(tmp_path):
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"name": "adamw", "lrr": 0.1})
    from disttrain.config.typed import registry_typed
    from disttrain.optim import OPTIMIZERS

    with pytest.raises(ConfigError, match=r"optim.lrr=.*optim keys are \[.*'lr'"):
        registry_typed("optim", cfg, OPTIMIZERS)


def test_bad_input_fails_before_any_worker_starts(make_config, tmp_path):
    cfg = make_config(["parallel=ddp", "trainer.devices=2", "optim.lr=-1"], tmp_path / "run")
    with pytest.raises(ConfigError):
        train(cfg)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("parallel=zero9", ["parallel='zero9' is invalid: one of", "'ddp'", "'single'"]),
        ("trainer.devices=two", ["trainer.devices", "two", "a positive number of ranks per node, or auto"]),
        ("optim.lrr=0.1", ["optim.lrr='0.1' is invalid: not a known key (did you mean optim.lr?)"]),
    ],
)
def test_command_line_errors_name_key_and_options(override, expected):
    proc = train_cli_in_process([override], ROOT)  # train.py as the interpreter runs it, in this process
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    for word in expected:
        assert word in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("batch", "dp", "expected"),
    [
        (BatchConfig(64, None, None), 2, (64, 32, 1)),
        (BatchConfig(64, 8, None), 2, (64, 8, 4)),
        (BatchConfig(64, None, 4), 2, (64, 8, 4)),
        (BatchConfig(None, 8, 2), 4, (64, 8, 2)),
        (BatchConfig(64, 8, 4), 2, (64, 8, 4)),
    ],
)
def test_batch_two_given_third_follows(batch, dp, expected):
    resolved = resolve_batch(batch, dp)
    assert (resolved.global_size, resolved.micro_size, resolved.accumulation) == expected


def test_parallel_dims_rest_of_world():
    dims = ParallelDims.resolve(8, pp=2, dp_replicate=1, dp_shard=-1, tp=2)
    assert dims.dp_shard == 2 and dims.world_size == 8 and dims.dp == 2
    with pytest.raises(ConfigError, match="does not divide"):
        ParallelDims.resolve(6, pp=4, dp_replicate=-1, dp_shard=1, tp=1)


def test_config_hash_ignores_run_dir(make_config, tmp_path):
    a = validate(make_config([], tmp_path / "a"))
    b = validate(make_config([], tmp_path / "b"))
    c = validate(make_config(["optim.lr=0.01"], tmp_path / "a"))
    assert a.config_hash == b.config_hash != c.config_hash


@pytest.mark.parametrize(("value", "expected"), [("1", 1), ("1.0", 1.0), ("0.25", 0.25), ("null", None)])
def test_a_batch_limit_keeps_count_or_fraction(make_config, value, expected):
    """As in Lightning: ``1`` is one batch, ``1.0`` all of them."""
    limit = validate(make_config([f"trainer.limit_val_batches={value}"])).train.trainer.limit_val_batches
    assert limit == expected and type(limit) is type(expected)


@pytest.mark.parametrize(("native", "bf16_seconds", "chosen", "says"), [
    (True, 0.5, "bf16-mixed", "this CPU has AMX and AVX512-BF16; bf16 autocast measured 2.00x the speed of fp32"),
    (True, 1.25, "32-true", "this CPU has AMX and AVX512-BF16; bf16 autocast measured 0.80x the speed of fp32"),
    (False, None, "32-true", "this CPU has no bf16 instructions)"),
])
def test_precision_auto_takes_bf16_where_native_and_measured_faster(make_config, monkeypatch, native, bf16_seconds,
                                                                    chosen, says):
    import torch

    from disttrain.config import precision

    for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        monkeypatch.setattr(torch.cpu, name, lambda: native)
    timed = []

    def step_seconds(model, batch, bf16):
        timed.append((type(model).__name__, tuple(batch[0].shape), bf16))
        return bf16_seconds if bf16 else 1.0

    monkeypatch.setattr(precision, "step_seconds", step_seconds)
    cfg = make_config(["trainer.precision=auto", "trainer.accelerator=cpu", "model=gpt", "data=pydocs",
                       "batch.global_size=8"])
    run = validate(cfg)
    assert run.train.trainer.precision == chosen  # and workers read the choice, not auto:
    assert OmegaConf.create(run.yaml).trainer.precision == chosen and cfg.trainer.precision == "auto"
    assert any(notice.startswith(f"trainer.precision=auto: {chosen} ({says}") for notice in run.notices), run.notices
    # the run's own model and micro-batch are timed, both ways; without native bf16 nothing is
    assert timed == ([("GPT", (8, 64), False), ("GPT", (8, 64), True)] if native else [])


def test_the_precision_probe_times_real_steps():
    import torch

    from disttrain.config.precision import step_seconds
    from disttrain.data.spec import DataSpec, example_batch
    from disttrain.models.cnn import CNNConfig, build_cnn

    spec = DataSpec(kind="image", num_classes=10, in_channels=1, image_size=8)
    model = build_cnn(CNNConfig(), spec)
    batch = example_batch(spec, 4)
    assert step_seconds(model, batch, bf16=False) > 0 and step_seconds(model, batch, bf16=True) > 0
    assert all(p.grad is None for p in model.parameters())  # the probe leaves no gradients behind
    assert batch[0].dtype == torch.float32 and batch[1].shape == (4,)


def test_a_step_interval_longer_than_an_epoch_validates_across_epochs(make_config):
    # GPT micro on pydocs: an epoch is 102 steps of 64 samples, here 204 batches of 32 under accumulation 2
    run = validate(make_config([*GPT_TEXT, "trainer.max_steps=300", "trainer.val_check_interval=300",
                                "batch.accumulation=2"]))
    assert run.train.trainer.check_val_every_n_epoch is None
    assert "check_val_every_n_epoch: null" in run.yaml  # the ranks read the decision, not the question
    assert any("val_check_interval=300 is longer than an epoch (204 batches)" in n for n in run.notices), run.notices
    inside = validate(make_config([*GPT_TEXT, "trainer.max_steps=300", "trainer.val_check_interval=100"]))
    assert inside.train.trainer.check_val_every_n_epoch == 1


def test_accumulation_with_batchnorm_is_announced(make_config):
    accumulating = validate(make_config(["batch.accumulation=2"]))  # the digits CNN has BatchNorm layers
    assert any("batch.accumulation=2 with BatchNorm layers" in n for n in accumulating.notices), accumulating.notices
    assert not any("BatchNorm" in n for n in validate(make_config([])).notices)
    assert not any("BatchNorm" in n for n in validate(make_config([*GPT_TEXT, "batch.accumulation=2"])).notices)


def test_sharding_on_one_rank_is_announced(make_config):
    one = validate(make_config(["parallel=zero3", "trainer.devices=1"]))
    assert any(n.startswith("parallel.zero_stage=3 on 1 rank: nothing to shard") for n in one.notices), one.notices
    two = validate(make_config(["parallel=zero3", "trainer.devices=2"]))
    assert not any("nothing to shard" in n for n in two.notices), two.notices


def test_a_config_error_crosses_processes_whole():
    import pickle

    err = pickle.loads(pickle.dumps(ConfigError("federated.mu", 0.0, "a positive proximal weight")))
    assert (err.key, err.value) == ("federated.mu", 0.0)
    assert str(err) == "federated.mu=0.0 is invalid: a positive proximal weight"


def test_validation_leaves_the_callers_config_unchanged(make_config):
    """Validation decides (ranks per node, PowerSGD's rank, the validation schedule) into the resolved copy that
    workers read, never into the object it was given."""
    cfg = make_config(["trainer.devices=auto", "parallel=ddp", "comm=powersgd", "model=gpt", "data=pydocs"])
    before = OmegaConf.to_yaml(cfg)
    run = validate(cfg)
    assert OmegaConf.to_yaml(cfg) == before
    resolved = OmegaConf.create(run.yaml)
    assert resolved.trainer.devices == run.train.trainer.devices == 2 and resolved.comm.rank == run.train.comm.rank


def test_nan_check_auto_waits_a_step_on_a_gpu_and_not_on_a_cpu(make_config, tmp_path):
    from disttrain.fault.config import FaultToleranceConfig

    for uses_gpu, decided in ((True, "next_step"), (False, "now")):
        config = FaultToleranceConfig()
        config.resolve_nan_check(uses_gpu)
        assert config.nan_check == decided
    run = validate(make_config([]))
    assert run.train.fault_tolerance.nan_check == "now"  # this suite's CPU, written where the ranks read it
    assert "nan_check: now" in run.yaml
    with pytest.raises(ConfigError, match=r"fault_tolerance.nan_check='later' is invalid: one of auto, now, "
                                          r"next_step"):
        validate(make_config(["fault_tolerance.nan_check=later"]))


def test_matmul_precision_auto_is_tf32_on_a_gpu_and_full_fp32_on_a_cpu(make_config):
    from disttrain.config.precision import resolve_matmul_precision

    assert resolve_matmul_precision("auto", uses_gpu=True) == "high"
    assert resolve_matmul_precision("auto", uses_gpu=False) == "highest"
    assert resolve_matmul_precision("medium", uses_gpu=False) == "medium"
    assert validate(make_config([])).train.trainer.matmul_precision == "highest"  # this suite's CPU
    with pytest.raises(ConfigError, match=r"trainer.matmul_precision='tf32' is invalid: one of auto, highest, "
                                          r"high, medium"):
        validate(make_config(["trainer.matmul_precision=tf32"]))


@pytest.mark.parametrize("overrides", [
    ["parallel=ddp", "trainer.devices=2"],
    ["model=gpt", "data=pydocs", "parallel=ddp", "trainer.devices=2", "comm=powersgd"],
    ["model=gpt", "data=pydocs", "parallel=hybrid", "parallel.tp=2", "trainer.devices=4"],
])
def test_a_rank_reads_the_run_the_job_validated_and_decides_nothing_again(make_config, monkeypatch, overrides):
    """A rank reads ``resolved.yaml`` (``rank_file``): every typed group, the layout, the batch and the plan come
    out as the job's validation left them (the PowerSGD rank the job resolved from the model included), and the
    rank neither validates nor builds a model to check it."""
    import dataclasses

    import disttrain.config.validation as validation
    from disttrain.config.resolved import load_rank_file, rank_file

    job = validate(make_config(overrides))
    assert job.train.comm.rank is not None or "comm=powersgd" not in overrides
    text = rank_file(job)

    def refused(*_args, **_kwargs):
        raise AssertionError("a rank validated or built the model to check it again")

    monkeypatch.setattr(validation, "model_on_meta", refused)
    monkeypatch.setattr(validation, "validate", refused)
    rank = load_rank_file(text, job.layout.world_size)
    groups = ("model", "data", "optim", "scheduler", "layout", "batch", "plan")
    assert [getattr(rank, name) for name in groups] == [getattr(job, name) for name in groups]
    raw = {name: None for name in ("model", "data", "optim", "scheduler")}  # the top level's copies of the groups
    assert dataclasses.replace(rank.train, **raw) == dataclasses.replace(job.train, **raw)
    assert rank.yaml == job.yaml and rank.config_hash == job.config_hash


def test_a_rank_of_a_smaller_world_reads_the_decisions_the_job_made_for_it(make_config):
    from disttrain.config.resolved import load_rank_file, rank_file

    job = validate(make_config(["parallel=ddp", "trainer.devices=1:2", "fault_tolerance.max_restarts=1",
                                "batch.global_size=32"]), world_size=2)
    assert job.world_sizes == (2, 1)
    text = rank_file(job)
    alone = load_rank_file(text, 1)
    assert (alone.layout.world_size, alone.batch.global_size, alone.batch.micro_size) == (1, 32, 32)
    assert load_rank_file(text, 2).batch == job.batch
    with pytest.raises(ConfigError, match="one of the world sizes the job validated"):
        load_rank_file(text, 3)


def test_a_refusal_spells_the_value_as_the_user_typed_it():
    from disttrain.errors import ConfigError

    assert str(ConfigError("a.flag", True, "false")) == "a.flag=true is invalid: false"
    assert str(ConfigError("a.path", None, "a file")) == "a.path=null is invalid: a file"
    assert str(ConfigError("a.names", ("x", False), "names")) == "a.names=['x', false] is invalid: names"
    assert str(ConfigError("a.name", "x", "y")) == "a.name='x' is invalid: y"
