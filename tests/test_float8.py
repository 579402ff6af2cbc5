"""``trainer.fp8``: torchao's float8 training of the linear layers, decided once before ranks start, on one process
and under ZeRO-3 with float8 weight gathers (torch's float8 products run on a CPU too)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from disttrain.errors import ConfigError
from disttrain.parallel.float8 import (
    Float8Layers,
    check_float8_device,
    choose_float8_layers,
    convert_to_float8,
    float8_layer_choice,
)
from tests.conftest import logged_metric
from tests.float8_scales import SCALES_FILE
from tests.test_run import GPT_FAST, step_losses

pytest.importorskip("torchao")

FP8_STEPS = ["trainer.max_steps=8", "trainer.limit_val_batches=0"]


class Odd(nn.Module):
    """Linear layers of every kind the choice tells apart."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(32, 64)
        self.odd = nn.Linear(64, 24 + 1)
        self.down = nn.Linear(64, 32)
        self.lm_head = nn.Linear(32, 256)


def test_the_head_and_layers_float8_cannot_take_stay_and_the_line_names_them():
    swapped, left = float8_layer_choice(Odd(), None)
    assert swapped == ["up", "down"]
    assert left == [("odd", "25x64, not multiples of 16"), ("lm_head", "the output head")]
    assert float8_layer_choice(Odd(), ["up"])[0] == ["up"]
    layers, line = choose_float8_layers(Odd(), "tensorwise", None, True, shards_parameters=True,
                                        precision="bf16-mixed")
    assert layers.modules == ("up", "down") and layers.all_gather
    assert line.startswith("trainer.fp8=tensorwise: 2 linear layers in float8")
    assert "gathered in float8" in line and "lm_head (the output head)" in line
    # rowwise has no float8 gather in torchao: the weights travel in the run's precision
    assert not choose_float8_layers(Odd(), "rowwise", None, True, True, "bf16-mixed")[0].all_gather
    with pytest.raises(ConfigError, match=r"trainer.fp8_layers.*none of the model's 4 linear layers"):
        choose_float8_layers(Odd(), "tensorwise", ["blocks.*"], True, True, "bf16-mixed")


@pytest.mark.parametrize("all_gather", [True, False])
def test_exactly_the_chosen_layers_are_swapped_with_their_names_and_weights_kept(all_gather):
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    net = Odd()
    before = {name: value.clone() for name, value in net.state_dict().items()}
    convert_to_float8(net, Float8Layers("tensorwise", ("up", "down"), all_gather))
    assert [name for name, m in net.named_modules() if isinstance(m, Float8Linear)] == ["up", "down"]
    # the weight FSDP2 gathers is torchao's float8-casting tensor exactly where the gather is to be float8
    assert isinstance(net.up.weight.data, WeightWithDynamicFloat8CastTensor) == all_gather
    after = net.state_dict()
    assert list(after) == list(before)  # checkpoints and exports read the same names
    assert all(torch.equal(torch.as_tensor(after[name]), before[name]) for name in before)


def test_what_float8_cannot_run_is_one_line_before_ranks_start(make_config, tmp_path):
    from disttrain.config.validation import validate

    check_float8_device(True, (9, 0))
    check_float8_device(False, None)
    with pytest.raises(ConfigError, match="compute capability 8.9 or more"):
        check_float8_device(True, (8, 0))
    with pytest.raises(ConfigError, match="trainer.fp8.*one of none, tensorwise, rowwise"):
        validate(make_config([*GPT_FAST, "trainer.fp8=e4m3"], tmp_path / "refused"))
    # tensor parallelism takes float8 layers (their styles: tests/test_float8_tp.py)
    validate(make_config([*GPT_FAST, "parallel=tp", "trainer.devices=2", "trainer.fp8=tensorwise"], tmp_path / "tp"))


def fp8_curve(make_config, run_dir, *overrides: str) -> torch.Tensor:
    """Losses and pre-clip gradient norms of a short GPT run with ``overrides``."""
    from disttrain.launch.job import train

    train(make_config([*GPT_FAST, *FP8_STEPS, *overrides], run_dir))
    norms = [value for _, value in logged_metric(run_dir, "train/grad_norm")]
    return torch.tensor([step_losses(run_dir), norms], dtype=torch.float64)


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    """One process's curves by name (fp32, or a recipe in float8), each trained once, when first asked."""
    from tests.conftest import compose_config

    class Curves(dict):
        def __missing__(self, name: str) -> torch.Tensor:
            fp8 = [] if name == "fp32" else [f"trainer.fp8={name}"]
            self[name] = fp8_curve(compose_config, tmp_path_factory.mktemp(name), *fp8)
            return self[name]

    return Curves()


@pytest.mark.parametrize("recipe", ["tensorwise", pytest.param("rowwise", marks=pytest.mark.slow)])
def test_a_float8_run_follows_the_fp32_curve_within_its_band(curves, recipe):
    reference, fp8 = curves["fp32"], curves[recipe]
    gap = ((fp8 - reference).abs() / reference).amax(dim=1)
    # float8 products round each operand to 3 (e4m3) or 2 (e5m2, gradients) mantissa bits: measured 2e-4 apart in
    # losses and 7.4e-3 (tensorwise) and 9.3e-3 (rowwise) in pre-clip norms over 8 steps of the micro GPT
    assert gap[0] < 5e-3 and gap[1] < 5e-2, gap
    assert gap[0] > 1e-5, "the float8 run equals the fp32 one: no layer trained in float8"


def test_zero3_gathers_float8_weights_as_it_gathers_its_whole_weights_before_the_cast(make_config, tmp_path):
    record = ["+callbacks.scales._target_=tests.float8_scales.RecordGatherScales"]
    runs = {gather: fp8_curve(make_config, tmp_path / f"zero3-{gather}", "trainer.fp8=tensorwise", "parallel=zero3",
                              "trainer.devices=2", f"trainer.fp8_all_gather={gather}", *record)
            for gather in ("true", "false")}
    # each weight is cast with the amax of the whole weight, taken across its shards, so the float8 weight gathered
    # is the one cast after gathering: the curves agree to the last bits (a cast scaled by the local shard's amax
    # alone is off from the first step). Against one process they are not compared: each rank scales its own
    # micro-batch's activations and gradients, as every data-parallel float8 run does.
    assert torch.allclose(runs["true"], runs["false"], rtol=1e-6, atol=0), runs
    # after every optimiser step each float8-gathered weight keeps the scale of its whole weight for the next step's
    # gathers, taken for all of them at once; gathered in the run's precision, no weight keeps one
    steps = {gather: json.loads((tmp_path / f"zero3-{gather}" / SCALES_FILE).read_text()) for gather in runs}
    layers = {len(rows) for run in steps.values() for rows in run}
    assert len(steps["true"]) == 8 and len(layers) == 1 and layers.pop() > 0, steps["true"]
    assert all(kept == expected for rows in steps["true"] for kept, expected in rows), steps["true"]
    assert all(kept is None for rows in steps["false"] for kept, _ in rows), steps["false"]


def test_a_load_drops_the_scales_taken_from_the_weights_it_replaces(tmp_path):
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from disttrain.parallel.config import ParallelConfig
    from disttrain.parallel.float8 import gathered_float8_weights
    from disttrain.parallel.layout import Layout
    from disttrain.parallel.strategy import DistTrainStrategy, StrategyHooks

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        layers = Float8Layers("tensorwise", ("up", "down"), all_gather=True)
        net = Odd()
        convert_to_float8(net, layers)
        fully_shard(net, mesh=init_device_mesh("cpu", (1,)))
        layers.after_optimizer_step(net)
        taken = [float(shard._precomputed_scale) for shard in gathered_float8_weights(net)]
        assert len(taken) == 2 and all(scale > 0 for scale in taken)

        def load_doubled(_path, model, _optimizers):  # as a checkpoint's load writes into the sharded weights
            set_model_state_dict(model, {name: 2 * value for name, value in model.state_dict().items()})
            return {}

        strategy = DistTrainStrategy(Layout(), ParallelConfig(), hooks=StrategyHooks(in_memory_checkpoint=load_doubled),
                                     float8=layers)
        task = nn.Module()
        task.net = net
        strategy.connect(task)
        strategy.load_checkpoint("doubled")
        # the scales of the weights before the load would cast the doubled ones past float8's range: dropped, the
        # next gathers take each loaded weight's amax themselves
        assert [shard._precomputed_scale for shard in gathered_float8_weights(net)] == [None, None]
    finally:
        if own_group:
            dist.destroy_process_group()


@pytest.mark.slow
def test_a_zero3_float8_run_killed_between_save_points_resumes_on_its_curve(tmp_path):
    from disttrain.launch.job import train
    from tests.conftest import ROOT, compose_config, train_cli_in_process

    run = [*GPT_FAST, "trainer.limit_val_batches=1", "trainer.max_steps=8", "trainer.val_check_interval=4",
           "trainer.check_val_every_n_epoch=null", "trainer.fp8=tensorwise", "parallel=zero3", "trainer.devices=2"]
    train(compose_config(run, tmp_path / "straight"))
    resumed = tmp_path / "resumed"
    crash = ["+callbacks.crash._target_=tests.crash.CrashAtStep", "+callbacks.crash.step=6"]
    crashed = train_cli_in_process([*run, *crash, f"hydra.run.dir={resumed}"], ROOT)
    assert crashed.returncode != 0
    again = train_cli_in_process([*run, "resume=auto", f"hydra.run.dir={resumed}"], ROOT)
    assert again.returncode == 0, again.stderr[-2000:]
    # the float8-casting weights and their optimiser state come back whole from the sharded checkpoint of step 4
    assert step_losses(resumed) == pytest.approx(step_losses(tmp_path / "straight"), rel=1e-6, abs=0)
