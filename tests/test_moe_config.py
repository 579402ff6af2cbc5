"""``model=moe``'s configuration errors and sizes, and Hugging Face mixture-of-experts architectures through
``model=hf`` (the layer against its per-token reference: ``test_moe_model.py``)."""

from __future__ import annotations

import math

import pytest

from disttrain.config import validate
from disttrain.errors import ConfigError
from disttrain.models.moe import MoEConfig, build_moe
from tests.test_moe_model import SPEC

# --- configuration ---------------------------------------------------------------------------------------------


MOE = ["model=moe", "model.flavour=micro", "data=pydocs"]


@pytest.mark.parametrize(("overrides", "key"), [
    (["model.n_experts=1"], r"model\.n_experts=1 .*at least 2"),
    (["model.n_experts=4", "model.top_k=5"], r"model\.top_k=5 .*model\.n_experts=4"),
    (["model.top_k=0"], r"model\.top_k=0 "),
    (["model.aux_loss_coef=-0.01"], r"model\.aux_loss_coef=-0\.01 "),
    (["model.capacity_factor=0"], r"model\.capacity_factor=0\.0 .*positive"),
    (["model.capacity_factor=-1.5"], r"model\.capacity_factor=-1\.5 "),
    (["model.bias_update_rate=-0.001"], r"model\.bias_update_rate=-0\.001 "),
    (["model.expert_hidden=0"], r"model\.expert_hidden=0 "),
    (["model.init_from=/nowhere"], r"model\.init_from='/nowhere' .*model=hf"),
], ids=["n_experts", "top_k-above", "top_k-zero", "aux_loss_coef", "capacity-zero", "capacity-negative",
        "bias_update_rate", "expert_hidden", "init_from"])
def test_bad_moe_configs_are_one_line(make_config, overrides, key):
    with pytest.raises(ConfigError, match=key) as raised:
        validate(make_config([*MOE, *overrides]))
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(("options", "hidden"), [
    ({}, 48),  # dense width 8/3 x 32 -> 96 (multiple_of 32), over 2 experts
    ({"top_k": 3}, 32),
    ({"shared_expert": True}, 32),  # 96 over 2 routed + 1 shared
    ({"n_embd": 48, "n_head": 4, "top_k": 3}, 48),  # 128 / 3 = 42.7, rounded up to a multiple of 8
    ({"n_embd": 48, "n_head": 4, "top_k": 1, "shared_expert": True}, 64),  # 128 over 1 routed + 1 shared
    ({"mlp_hidden": 100}, 56),  # 50, up to 56
    ({"mlp_hidden": 100, "expert_hidden": 20}, 20),
])
def test_default_expert_width_divides_the_dense_one(options, hidden):
    cfg = MoEConfig(flavour="micro", n_experts=4, **options)
    assert cfg.validate(SPEC).expert_hidden == hidden
    assert build_moe(cfg, SPEC).layers[0].feed_forward.experts.w1.shape == (4, cfg.validate(SPEC).n_embd, hidden)


@pytest.mark.parametrize("shared", [False, True])
def test_active_params_count_the_experts_a_token_uses(shared):
    """micro: 2 layers of width 32, 4 query heads of 8 and 2 key/value heads, vocabulary 64; 8 experts of width
    24 (dense 96 over top 3 + shared, or over top 4), 3 of them (or 4) per token."""
    top_k = 3 if shared else 4
    model = build_moe(MoEConfig(flavour="micro", n_experts=8, top_k=top_k, shared_expert=shared), SPEC)
    assert model.dims.expert_hidden == 24
    attention = 32 * 32 + 32 * 16 + 32 * 16 + 32 * 32
    norms = 2 * 32
    router = 8 * 32
    expert = 3 * 32 * 24
    per_layer_all = attention + norms + router + 8 * expert + (expert if shared else 0)
    per_layer_active = attention + norms + router + top_k * expert + (expert if shared else 0)
    head = 32 + 64 * 32  # final norm and the untied output layer
    embedding = 64 * 32
    assert model.num_params() == 2 * per_layer_all + head
    assert model.active_params() == 2 * per_layer_active + head
    assert model.active_params(non_embedding=False) == 2 * per_layer_active + head + embedding


# --- Hugging Face mixture-of-experts models --------------------------------------------------------------------


HF_TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 64, "num_experts_per_tok": 2}
HF_MOE = {"qwen3_moe": {**HF_TINY, "num_experts": 4, "moe_intermediate_size": 32},
          "mixtral": {**HF_TINY, "num_local_experts": 4}}
"""Qwen3-MoE (``Qwen3MoeConfig``) and Mixtral (``MixtralConfig``): 4 experts, 2 per token."""


def hf_moe_overrides(arch: str, extra: dict | None = None) -> list[str]:
    pytest.importorskip("transformers")
    from tests.test_hf_models import hf_overrides

    return hf_overrides(arch, {**HF_MOE[arch], **(extra or {})})


@pytest.mark.parametrize("arch", list(HF_MOE))
def test_hf_moe_trains_in_one_process(tmp_path, arch):
    """Built from its config by ``model=hf`` (nothing downloaded), three SGD steps through the runner: every
    step's loss and gradient norm is logged and finite, the loss falls, and the checkpoint holds the model's
    router and its experts as ``[n_experts, ...]`` weights under their Hugging Face names."""
    from disttrain.checkpoint.export import consolidated_weights
    from disttrain.launch.job import train
    from tests.conftest import compose_config, logged_metric
    from tests.test_run import step_losses

    run_dir = tmp_path / "run"
    train(compose_config([*hf_moe_overrides(arch), "trainer.max_steps=3", "trainer.val_check_interval=3"], run_dir))
    losses = step_losses(run_dir)
    norms = [value for _, value in logged_metric(run_dir, "train/grad_norm")]
    assert len(losses) == len(norms) == 3
    assert all(math.isfinite(v) and v > 0 for v in losses + norms)
    assert losses[-1] < losses[0]
    weights = consolidated_weights(run_dir / "checkpoints" / "last.ckpt")
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp"
        assert weights[f"{prefix}.gate.weight"].shape == (4, 64)
        assert weights[f"{prefix}.experts.gate_up_proj"].shape[0] == 4
        assert weights[f"{prefix}.experts.down_proj"].shape[0] == 4
