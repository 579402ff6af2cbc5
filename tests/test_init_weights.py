"""``model.init_weights``: a run starts from exactly a safetensors file's tensors, under every layout, and a file
that does not fit the model (or is no safetensors file) is refused in one line before any rank starts."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from disttrain.checkpoint.export import consolidated_weights
from disttrain.checkpoint.init_weights import InitWeightsFile, start_from_init_weights
from disttrain.config import validate
from disttrain.config.resolved import load_rank_file, rank_file
from disttrain.errors import ConfigError
from disttrain.launch.job import train
from disttrain.models import build_model
from tests.conftest import logged_metric, val_loss_of_weights
from tests.test_export_safetensors import export_status
from tests.test_run import GPT_FAST, step_losses

GPT_INIT = [*GPT_FAST, "trainer.max_steps=2", "trainer.validate_before_training=true"]
"""Two steps of the micro GPT, scored on the validation batches before the first (the starting weights)."""
TIED = "lm_head.weight"
"""The micro GPT's head, which shares the token embedding's tensor: a file holds it once, as embed.wte.weight."""


def micro_gpt_state(make_config, run_dir: Path) -> dict[str, torch.Tensor]:
    """The micro GPT's state dict as the seed 1234 initialises it, then moved by 0.01: the weights no seeded
    init of the run (seed 0) can equal, by construction."""
    run = validate(make_config(GPT_FAST, run_dir))
    torch.manual_seed(1234)
    net = build_model(run.model, run.datamodule.spec)
    with torch.no_grad():
        return {name: tensor.detach().clone() + 0.01 for name, tensor in net.state_dict().items()}


def write(state: dict[str, torch.Tensor], path: Path) -> Path:
    """``state`` as a safetensors file, the tied head left out (the embedding holds it)."""
    save_file({name: tensor.contiguous() for name, tensor in state.items() if name != TIED}, str(path))
    return path


@pytest.fixture
def weights(make_config, tmp_path):
    """A weights file of the micro GPT and the whole state it stands for (the head equal to the embedding)."""
    state = micro_gpt_state(make_config, tmp_path / "probe")
    state[TIED] = state["embed.wte.weight"]
    return write(state, tmp_path / "start.safetensors"), state


def test_the_model_a_rank_builds_holds_the_files_tensors(make_config, tmp_path, weights):
    path, state = weights
    run = validate(make_config([*GPT_FAST, f"model.init_weights={path}"], tmp_path / "run"))
    assert run.model.init_weights == str(path.resolve())
    # the file as the job checked it: named at start, and handed to the ranks for results.json
    assert run.init_weights == InitWeightsFile(str(path.resolve()), len(state) - 1, path.stat().st_size)
    assert f"model.init_weights: the model starts from {path.resolve()} ({len(state) - 1} tensors, " \
           f"{path.stat().st_size:,} bytes), at step 0 with a fresh optimiser" in run.notices
    assert load_rank_file(rank_file(run), 1).init_weights == run.init_weights
    continued = validate(make_config([*GPT_FAST, f"model.init_weights={path}", "resume=auto"], tmp_path / "again"))
    assert any(line.endswith("bytes); resume=auto is set beside it: a checkpoint it finds replaces these weights")
               for line in continued.notices), continued.notices
    net = start_from_init_weights(build_model(run.model, run.datamodule.spec), run.model)  # as a rank does
    seeded = build_model(validate(make_config(GPT_FAST, tmp_path / "seeded")).model, run.datamodule.spec)
    for name, tensor in net.state_dict().items():
        assert torch.equal(tensor, state[name]), name
        assert not torch.equal(seeded.state_dict()[name], state[name]), name  # the premise: not the seeded init
    assert net.lm_head.weight is net.embed.wte.weight  # still tied


@pytest.mark.parametrize(("preset", "ranks"), [
    ("single", 1),
    pytest.param("zero3", 2, marks=pytest.mark.slow),
])
def test_a_run_starts_at_the_files_loss_and_its_export_starts_the_next(make_config, tmp_path, weights, preset,
                                                                       ranks, capsys):
    """A run from the file starts at the file's loss and records the file in ``results.json``; its last
    checkpoint, exported as safetensors, starts a second run at exactly the weights and loss the first ended
    with."""
    path, state = weights
    layout = [f"parallel={preset}", f"trainer.devices={ranks}"]
    run_dir = tmp_path / preset
    train(make_config([*GPT_INIT, "trainer.val_check_interval=2", f"model.init_weights={path}", *layout], run_dir))
    (first_step, first_val), (last_step, last_val) = logged_metric(run_dir, "val/loss")
    assert (first_step, last_step) == (0, 2)  # scored before the first step and on the weights last.ckpt holds
    assert first_val == pytest.approx(val_loss_of_weights(run_dir, state), rel=1e-6)
    assert len(step_losses(run_dir)) == 2
    assert f"model.init_weights: the model starts from {path.resolve()} ({len(state) - 1} tensors" in \
        capsys.readouterr().out  # the job's start-up line
    recorded = json.loads((run_dir / "results.json").read_text())["init_weights"]
    assert recorded == {"path": str(path.resolve()), "tensors": len(state) - 1, "size_bytes": path.stat().st_size}

    exported = tmp_path / "exported.safetensors"
    assert export_status(run_dir, "--format", "safetensors", exported) == 0
    checkpoint = consolidated_weights(run_dir / "checkpoints" / "last.ckpt")
    assert torch.equal(checkpoint["embed.wte.weight"], checkpoint[TIED])  # the tie held through training
    next_run = [*GPT_INIT, "trainer.max_steps=1", f"model.init_weights={exported}", *layout]
    run = validate(make_config(next_run, tmp_path / "probe"))
    net = start_from_init_weights(build_model(run.model, run.datamodule.spec), run.model)  # as a rank does
    for name, tensor in net.state_dict().items():
        assert torch.equal(tensor, checkpoint[name]), name
    train(make_config(next_run, tmp_path / "next"))
    assert logged_metric(tmp_path / "next", "val/loss")[0] == (0, last_val)  # exactly: the same weights, scored alike


def test_zero3_starts_at_the_loss_of_one_process(make_config, tmp_path, weights):
    """Under ZeRO-3 on 2 ranks, the first training loss is one process's (the data order is the same)."""
    path, _ = weights
    losses = {}
    for preset, ranks in (("single", 1), ("zero3", 2)):
        run_dir = tmp_path / preset
        train(make_config([*GPT_FAST, "trainer.max_steps=1", f"model.init_weights={path}", f"parallel={preset}",
                           f"trainer.devices={ranks}"], run_dir))
        losses[preset] = step_losses(run_dir)[0]
    assert losses["zero3"] == pytest.approx(losses["single"], rel=1e-6)


def refusal(make_config, tmp_path, path: Path, model: list[str] | None = None) -> str:
    """The one line ``validate`` refuses ``model.init_weights=path`` with."""
    with pytest.raises(ConfigError) as refused:
        validate(make_config([*(model or GPT_FAST), f"model.init_weights={path}"], tmp_path / "run"))
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"model.init_weights='{path.resolve()}' is invalid")
    return message


def test_a_missing_tensor_is_named(make_config, tmp_path, weights):
    _, state = weights
    del state["blocks.1.mlp.fc.weight"]
    message = refusal(make_config, tmp_path, write(state, tmp_path / "short.safetensors"))
    assert "it lacks blocks.1.mlp.fc.weight, of shape [128, 32]" in message


def test_an_unexpected_tensor_is_named(make_config, tmp_path, weights):
    _, state = weights
    state["blocks.2.attn.q.weight"] = torch.zeros(32, 32)
    message = refusal(make_config, tmp_path, write(state, tmp_path / "long.safetensors"))
    assert "long.safetensors holds blocks.2.attn.q.weight, which the model has not" in message


def test_a_tensor_of_another_shape_is_named(make_config, tmp_path, weights):
    _, state = weights
    state["embed.wpe.weight"] = torch.zeros(64, 32)
    message = refusal(make_config, tmp_path, write(state, tmp_path / "wide.safetensors"))
    assert "wide.safetensors holds embed.wpe.weight as [64, 32], where the model's is [32, 32]" in message


def test_a_file_that_is_not_safetensors_is_refused(make_config, tmp_path):
    text = tmp_path / "notes.safetensors"
    text.write_text("these are not weights\n")
    assert "notes.safetensors is not a safetensors file" in refusal(make_config, tmp_path, text)
    assert "absent.safetensors is not there" in refusal(make_config, tmp_path, tmp_path / "absent.safetensors")


def test_a_file_cut_short_is_refused_by_how_many_bytes(make_config, tmp_path, weights):
    path, _ = weights
    short = tmp_path / "cut.safetensors"
    short.write_bytes(path.read_bytes()[:-40])
    message = refusal(make_config, tmp_path, short)
    assert "a safetensors file of the model's state_dict; cut.safetensors is cut short by 40 bytes (" in message


class _Touch:
    """Unpickling it creates a file: what a crafted pickle would run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return Path.touch, (self.marker,)


@pytest.mark.parametrize("writer", ["pickle", "torch.save"])
def test_a_pickle_is_refused_and_runs_nothing(make_config, tmp_path, writer):
    marker = tmp_path / "ran"
    crafted = tmp_path / "crafted.safetensors"
    if writer == "pickle":
        crafted.write_bytes(pickle.dumps({"embed.wte.weight": _Touch(marker)}))
    else:
        torch.save({"embed.wte.weight": _Touch(marker)}, crafted)
    assert "crafted.safetensors is not a safetensors file" in refusal(make_config, tmp_path, crafted)
    assert not marker.exists()


@pytest.mark.parametrize(("model", "other"), [
    (["model=llama", "model.flavour=micro", "model.init_from=/nowhere"], "model.init_from='/nowhere'"),
    (["model=hf", "model.path=/nowhere", "model.pretrained=true"], "model.pretrained=true"),
])
def test_another_source_of_starting_weights_is_refused_beside_it(make_config, tmp_path, weights, model, other):
    path, _ = weights
    message = refusal(make_config, tmp_path, path, ["data=pydocs", "data.block_size=32", *model])
    assert f"null with {other}" in message


def test_a_model_with_adapters_starts_its_base_from_the_file(make_config, tmp_path, weights):
    """LoRA wraps the projections (``q.base_layer.weight``): the file holds the base model's names, and the
    adapters keep their own initialisation."""
    path, state = weights
    run = validate(make_config([*GPT_FAST, "model.lora.rank=4", f"model.init_weights={path}"], tmp_path / "run"))
    net = start_from_init_weights(build_model(run.model, run.datamodule.spec), run.model)
    assert torch.equal(net.blocks[0].attn.q.base_layer.weight, state["blocks.0.attn.q.weight"])
    assert torch.equal(net.embed.wte.weight, state["embed.wte.weight"])
    assert not torch.any(net.blocks[0].attn.q.lora_B["default"].weight)  # an adapter's own init: B at zero
