"""LoRA adapters (``model.lora``, through PEFT): which modules they wrap, that they alone train, that every layout
equals one process, that a run started from a Hugging Face folder keeps the folder's base weights bit for bit,
that the optimiser holds state for the adapters only, and the settings refused before any rank starts.

The adapters start with both matrices random (``model.lora.init=random``), so they change the model's output
from the first step and a wrong adapter gradient moves the loss curve at once.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from disttrain.config import validate  # noqa: E402
from disttrain.errors import ConfigError  # noqa: E402
from disttrain.models import build_model  # noqa: E402
from disttrain.models.lora import base_name, is_adapter  # noqa: E402
from tests.test_hf_models import hf_overrides, saved_folder  # noqa: E402
from tests.test_parity import BASE, FAMILIES, run_summary  # noqa: E402

ADAPTERS = ["model.lora.rank=4", "model.lora.init=random"]
# measured (fp32, gloo, 2 ranks, plain SGD lr 0.5): losses within 8.9e-8 relative of one process (GPT and HF Llama,
# ddp and zero3), adapter weights within 2.3e-7 absolute, base weights equal; the issue asks for 1e-5
LOSS_RTOL, ADAPTER_ATOL = 1e-5, 1e-5
HF_LLAMA = [o for o in hf_overrides("llama", {}) if not o.startswith("model.arch")]


def built(make_config, overrides: list[str]) -> tuple[torch.nn.Module, tuple[str, ...]]:
    """The model a run of ``overrides`` builds, and the run's start-up notices."""
    run = validate(make_config(overrides))
    return build_model(run.model, run.datamodule.spec), run.notices


@pytest.mark.parametrize(("model", "targets"), [
    (["model=gpt", "model.flavour=micro"], {"q", "k", "v", "proj", "fc"}),
    (["model=llama", "model.flavour=micro"], {"q", "k", "v", "o", "w1", "w2", "w3"}),
    (["model=moe", "model.flavour=micro"], {"q", "k", "v", "o"}),
    ([*hf_overrides("llama", {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                              "num_attention_heads": 2, "num_key_value_heads": 2})],
     {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}),
])
def test_adapters_wrap_the_projections_of_the_models_plan_and_alone_train(make_config, model, targets):
    """The default targets are the projections the model's tensor-parallel plan splits; every other parameter is
    frozen, and the start-up line names the adapters' count, share and targets."""
    net, notices = built(make_config, [*(o for o in BASE if not o.startswith("model")), *model, *ADAPTERS])
    wrapped = {name.rpartition(".")[2] for name, module in net.named_modules() if hasattr(module, "lora_A")}
    assert wrapped == targets
    trainable = [name for name, p in net.named_parameters() if p.requires_grad]
    assert trainable and all(is_adapter(name) for name in trainable)
    assert all(".lora_A." in name or ".lora_B." in name for name in trainable)
    count = sum(p.numel() for p in net.parameters() if p.requires_grad)
    line = next(notice for notice in notices if notice.startswith("model.lora:"))
    assert f"{count:,} trainable parameters" in line and ", ".join(sorted(targets)) in line


def test_base_dtype_bfloat16_holds_the_frozen_weights_in_bf16(make_config):
    net, _ = built(make_config, [*BASE, *ADAPTERS, "model.lora.base_dtype=bfloat16"])
    dtypes = {is_adapter(name): {p.dtype} for name, p in net.named_parameters()}
    assert dtypes == {True: {torch.float32}, False: {torch.bfloat16}}


@pytest.mark.parametrize(("change", "key", "says"), [
    (["model.lora.rank=0"], "model.lora.rank", "a positive integer"),
    (["model.lora.target_modules=[q,qkv]"], "model.lora.target_modules", "'qkv' is none of them .*fc, k, lm_head"),
    (["model.lora.init=pissa"], "model.lora.init", "one of kaiming, gaussian, random"),
])
def test_a_lora_setting_the_model_cannot_take_is_one_line(make_config, change, key, says):
    with pytest.raises(ConfigError, match=rf"^{key}=.* is invalid: .*{says}"):
        validate(make_config([*BASE, *ADAPTERS, *change]))


def test_a_model_without_a_plan_needs_its_targets_named(make_config):
    """GPT-2 in ``transformers`` declares no tensor-parallel plan: the error lists the layers to name instead."""
    gpt2 = {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64}
    with pytest.raises(ConfigError, match=r"^model\.lora\.target_modules=null is invalid: .*declares no "
                                          r"tensor-parallel plan .*lm_head"):
        validate(make_config([*hf_overrides("gpt2", gpt2), *ADAPTERS]))


GPT_LAYOUTS = {"ddp": [], "zero3": [], "zero1": [pytest.mark.slow], "zero2": [pytest.mark.slow]}


@pytest.fixture(scope="module")
def gpt_reference(tmp_path_factory) -> dict:
    return run_summary(tmp_path_factory.mktemp("gpt-one"), [*BASE, *FAMILIES["sgd"], *ADAPTERS])


def check_adapter_parity(reference: dict, got: dict) -> None:
    """Losses and adapters as one process's; the frozen weights exactly as its."""
    assert got["last_step"] == reference["last_step"]
    deviation = max(abs(a - b) / abs(a) for a, b in zip(reference["losses"], got["losses"], strict=True))
    assert deviation <= LOSS_RTOL, deviation
    assert got["weights"].keys() == reference["weights"].keys()
    for name, weight in got["weights"].items():
        atol = ADAPTER_ATOL if is_adapter(name) else 0
        torch.testing.assert_close(weight, reference["weights"][name], rtol=0, atol=atol, msg=name)


@pytest.mark.parametrize("layout", [pytest.param(name, marks=marks) for name, marks in GPT_LAYOUTS.items()])
def test_gpt_adapters_match_one_process(tmp_path, gpt_reference, layout):
    got = run_summary(tmp_path / "run", [*BASE, *FAMILIES["sgd"], *ADAPTERS, f"parallel={layout}",
                                         "trainer.devices=2"])
    check_adapter_parity(gpt_reference, got)


def summary_of_folder_run(run_dir: Path, folder: Path, overrides: list[str]) -> dict:
    """``run_summary`` of a run started from ``folder`` (its exported weights are compared by the export tests:
    the bare model of this process starts on the meta device)."""
    import tests.test_parity as parity

    original = parity.exported_val_loss
    parity.exported_val_loss = lambda *_: float("nan")
    try:
        own_optimiser = any(o.startswith("optim=") for o in overrides)
        base = [o for o in HF_LLAMA if not (own_optimiser and o.startswith("optim"))]
        return run_summary(run_dir, [*base, f"model.path={folder}", "model.pretrained=true", *FAMILIES["sgd"],
                                     *ADAPTERS, *overrides])
    finally:
        parity.exported_val_loss = original


@pytest.mark.parametrize("layout", ["zero3", pytest.param("ddp", marks=pytest.mark.slow)])
def test_hf_adapters_on_a_folder_match_one_process_and_keep_its_weights(tmp_path, layout):
    """A Llama started from a saved folder (read shard by shard under ZeRO-3, its adapters drawn when it was built
    on the meta device): one process's curve and adapters, and the folder's base weights bit for bit."""
    from safetensors.torch import load_file

    folder = saved_folder(tmp_path / "hf")
    reference = summary_of_folder_run(tmp_path / "one", folder, [])
    got = summary_of_folder_run(tmp_path / "run", folder, [f"parallel={layout}", "trainer.devices=2"])
    check_adapter_parity(reference, got)
    saved = load_file(folder / "model.safetensors")
    for name, weight in got["weights"].items():
        if not is_adapter(name):
            assert torch.equal(weight, saved[base_name(name)]), name


def test_zero3_optimiser_state_is_the_adapters_shard(tmp_path):
    """AdamW under ZeRO-3 on 2 ranks: the optimiser state holds the adapters' two moments alone, half of them on
    each rank (measured from the checkpoint's record of the state chunks each rank wrote)."""
    from torch.distributed.checkpoint import FileSystemReader

    folder = saved_folder(tmp_path / "hf")
    summary = summary_of_folder_run(tmp_path / "run", folder, ["optim=adamw", "parallel=zero3", "trainer.devices=2"])
    adapters = sum(w.numel() for name, w in summary["weights"].items() if is_adapter(name))
    metadata = FileSystemReader(str(tmp_path / "run" / "checkpoints" / "last.ckpt")).read_metadata()
    state = {fqn: meta for fqn, meta in metadata.state_dict_metadata.items()
             if fqn.startswith("optimizer_0.state.") and fqn.endswith(("exp_avg", "exp_avg_sq"))}
    assert state and all(is_adapter(fqn) for fqn in state)
    per_rank: dict[str, int] = {}
    for index, info in metadata.storage_data.items():
        if index.fqn in state:
            meta = state[index.fqn]
            chunk = next(c for c in meta.chunks if tuple(c.offsets) == tuple(index.offset))
            per_rank[info.relative_path] = per_rank.get(info.relative_path, 0) + \
                chunk.sizes.numel() * meta.properties.dtype.itemsize
    assert sorted(per_rank.values()) == [adapters * 2 * 4 // 2] * 2, (per_rank, adapters)
