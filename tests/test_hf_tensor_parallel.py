"""Tensor parallelism of Hugging Face families whose ``base_model_tp_plan`` uses more than column- and row-wise
layers, through the real runner at parity with one process; the styles disttrain refuses; a plan given on the
command line.

Phi-3 gathers its fused qkv and gate_up projections (``colwise_gather_output``, ``rowwise_split_input``), GPT-NeoX
splits its embedding by vocabulary (``embedding_rowwise``) and views its fused qkv per head, Mixtral and DeepSeek
split their grouped experts (``moe_tp_experts``), DeepSeek-V2 shares a rotary key over its heads
(``mla_kv_a_proj``). Each is compared with one process as ``tests/test_hf_models.py`` compares Llama: plain SGD
with clipping that binds every step, so a gradient not summed over the tp ranks moves the pre-clip norms, the
losses and every weight.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from disttrain.checkpoint.export import consolidated_weights  # noqa: E402
from disttrain.checkpoint.io import load_metadata  # noqa: E402
from disttrain.config import validate  # noqa: E402
from disttrain.errors import ConfigError  # noqa: E402
from tests.conftest import NO_PLOTS, exported_val_loss, logged_metric, train_cli_in_process  # noqa: E402
from tests.test_hf_models import LOSS_RTOL, TINY, WEIGHT_ATOL, hf_overrides  # noqa: E402
from tests.test_parity import FAMILIES, check_against, run_summary, single_process_runs  # noqa: E402
from tests.test_run import step_losses  # noqa: E402

MLA = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 4, "max_position_embeddings": 64, "q_lora_rank": 32, "kv_lora_rank": 32,
       "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "moe_intermediate_size": 32,
       "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
       "n_group": 1, "topk_group": 1}  # layer 0 dense, layer 1 a mixture with a shared expert
ARCHS = {
    "phi3": {**TINY, "pad_token_id": 0},  # its default pad token (32000) is outside the tiny vocabulary
    "gpt_neox": {key: value for key, value in TINY.items() if key != "num_key_value_heads"},
    "olmo2": TINY,
    "mixtral": {**TINY, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {**TINY, "moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2},
    "deepseek_v3": MLA,
    "deepseek_v2": MLA,
}
CASES = ["phi3", "gpt_neox", "mixtral", "deepseek_v2"]
SLOW_CASES = ["olmo2", "qwen3_moe", "deepseek_v3"]
TP = ["parallel=tp", "trainer.devices=2"]
# pre-clip norms measured within 1.2e-6 relative of one process (Phi-3, whose gathered outputs add in another
# order), as test_hf_models' losses; a gradient not summed over the tp ranks moves them by 1e-3 or more
NORM_RTOL = 2e-6
MIXTRAL_ATTENTION_PLAN = ("{model.layers.*.self_attn.q_proj:colwise,model.layers.*.self_attn.k_proj:colwise,"
                          "model.layers.*.self_attn.v_proj:colwise,model.layers.*.self_attn.o_proj:rowwise}")


def overrides(arch: str) -> list[str]:
    return [*hf_overrides(arch, ARCHS[arch]), *FAMILIES["sgd+clip"]]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One process per family, computed when first asked for."""
    return single_process_runs(tmp_path_factory, overrides)


@pytest.mark.parametrize("arch", CASES)
def test_tensor_parallel_family_matches_one_process(tmp_path, references, arch):
    got = run_summary(tmp_path / "run", [*overrides(arch), *TP])
    check_against(references(arch), got, clipped=True, loss_rtol=LOSS_RTOL, weight_atol=WEIGHT_ATOL,
                  norm_rtol=NORM_RTOL)


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "layout"), [*((arch, TP) for arch in SLOW_CASES),
                                              ("mixtral", ["parallel=hybrid", "parallel.tp=2", "trainer.devices=4"])],
                         ids=[*SLOW_CASES, "mixtral-dp_shard2xtp2"])
def test_more_tensor_parallel_families_match_one_process(tmp_path, references, arch, layout):
    got = run_summary(tmp_path / "run", [*overrides(arch), *layout])
    check_against(references(arch), got, clipped=True, loss_rtol=LOSS_RTOL, weight_atol=WEIGHT_ATOL,
                  norm_rtol=NORM_RTOL)


def summary_of(run_dir: Path) -> dict:
    """What ``run_summary`` returns, of a run the command line trained."""
    last = run_dir / "checkpoints" / "last.ckpt"
    return {"losses": step_losses(run_dir), "norms": [value for _, value in logged_metric(run_dir, "train/grad_norm")],
            "val_loss": logged_metric(run_dir, "val/loss")[-1][1], "last_step": load_metadata(last)["global_step"],
            "weights": consolidated_weights(last), "exported_val_loss": exported_val_loss(run_dir, last,
                                                                                     run_dir / "model.pt")}


def test_a_plan_on_the_command_line_trains_as_one_process(tmp_path, references):
    """``parallel.tp_plan={...}`` typed on the command line (Mixtral, attention only: the experts stay whole on
    both ranks) is read as the same plan in a YAML file is, and trains at parity with one process."""
    run_dir = tmp_path / "run"
    proc = train_cli_in_process([*overrides("mixtral"), *TP, f"parallel.tp_plan={MIXTRAL_ATTENTION_PLAN}",
                                 NO_PLOTS, f"run_dir={run_dir}"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    check_against(references("mixtral"), summary_of(run_dir), clipped=True, loss_rtol=LOSS_RTOL,
                  weight_atol=WEIGHT_ATOL, norm_rtol=NORM_RTOL)


def test_a_plan_that_is_not_a_mapping_is_one_line(tmp_path):
    proc = train_cli_in_process([*overrides("mixtral"), *TP, "parallel.tp_plan=[q_proj]"], tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("Error: parallel.tp_plan=['q_proj'] is invalid: null or a mapping"), lines[0]


def test_experts_split_whole_need_a_tp_degree_that_divides_them(make_config):
    fields = {**ARCHS["mixtral"], "num_local_experts": 3}
    with pytest.raises(ConfigError, match=r"parallel\.tp=2 is invalid: a divisor of the 3 experts of "
                                          r"model\.layers\.0\.mlp\.experts"):
        validate(make_config([*hf_overrides("mixtral", fields), *TP]))


@pytest.mark.parametrize(("style", "why"), [("local_params", "bare parameters"), ("packed_rowwise", "strided"),
                                            ("all_reduce", "summed twice")])
def test_a_refused_style_names_itself_why_and_the_plan_without_it(style, why):
    from disttrain.data.spec import DataSpec
    from disttrain.models.hf import HFConfig, build_hf
    from disttrain.models.hf.tp_plan import tp_plan

    net = build_hf(HFConfig(arch="llama", fields=TINY), DataSpec("text", vocab_size=256, block_size=32))
    net.hf_config.base_model_tp_plan = {**net.hf_config.base_model_tp_plan, "layers.*.self_attn": style}
    with pytest.raises(ConfigError) as refused:
        tp_plan(net)
    message = str(refused.value)
    assert "\n" not in message and message.startswith(f"parallel.tp='layers.*.self_attn: {style}' is invalid: "
                                                      "1 for model type llama, or parallel.tp_plan='{"), message
    assert "model.layers.*.self_attn.q_proj:colwise" in message and f"style {style}" in message, message
    assert why in message, message


def test_a_module_inside_split_experts_keeps_its_own_entry():
    """An experts module's own parameters are covered by its whole-expert split; a module inside it (LongCat's
    identity expert, here attached to Mixtral's experts) keeps its entry, and its style is refused."""
    from torch import nn

    from disttrain.data.spec import DataSpec
    from disttrain.models.hf import HFConfig, build_hf
    from disttrain.models.hf.tp_plan import tp_plan

    net = build_hf(HFConfig(arch="mixtral", fields=ARCHS["mixtral"]), DataSpec("text", vocab_size=256, block_size=32))
    assert "model.layers.*.mlp.experts.gate_up_proj" not in tp_plan(net)
    for layer in net.model.layers:
        layer.mlp.experts.identity_expert = nn.Identity()
    net.hf_config.base_model_tp_plan = {**net.hf_config.base_model_tp_plan,
                                        "layers.*.mlp.experts.identity_expert": "moe_identity_expert"}
    with pytest.raises(ConfigError, match=r"style moe_identity_expert .*would add it tp times"):
        tp_plan(net)


def test_the_declared_plan_translates_every_family():
    """Every family here gets a plan from its config, each entry naming modules it has (entries for modules a
    config variant lacks, such as DeepSeek-V2's q_proj beside a low-rank query, are left out)."""
    from disttrain.data.spec import DataSpec
    from disttrain.models.hf import HFConfig, build_hf
    from disttrain.parallel.tp import check_tp_plan

    for arch, fields in ARCHS.items():
        net = build_hf(HFConfig(arch=arch, fields=fields), DataSpec("text", vocab_size=256, block_size=32))
        plan = net.tp_plan()
        check_tp_plan(net, plan, 2, False, "tp_plan()")
        assert plan, arch
    assert "model.layers.*.self_attn.q_proj" not in plan and plan["model.layers.*.mlp.experts"] == "experts"
    assert plan["model.layers.*.self_attn.kv_a_proj_with_mqa"] == "mla_kv_a"


def test_whole_experts_sum_to_the_mixture_of_one_process():
    """The experts of each tp rank, run on the same tokens, sum to the whole mixture's output and gradients
    (a unit check of the style the runs above use)."""
    from tests.dist_utils import run_on_ranks

    reference = _experts_pass(1)
    for got in run_on_ranks(_experts_pass, 2, 2):
        for name, value in reference.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)


def _experts_pass(tp: int) -> dict[str, torch.Tensor]:
    import transformers
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from disttrain.parallel.tp import apply_tp

    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("mixtral", vocab_size=256, **ARCHS["mixtral"])
    block = transformers.AutoModelForCausalLM.from_config(config).model.layers[0].mlp
    if tp > 1:
        apply_tp(block, init_device_mesh("cpu", (tp,)), {"experts": "experts"})
    hidden = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = block(hidden)
    out.square().sum().backward()
    grads = {name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
             for name, p in block.named_parameters()}
    return {"out": out.detach(), "input grad": hidden.grad, **grads}

