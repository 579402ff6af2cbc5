"""Hugging Face mixtures of experts (Mixtral, Qwen3-MoE; Qwen2-MoE and DeepSeek-V3 among the slow cases) under
expert parallelism: their grouped experts split over the ep ranks (``disttrain.models.hf.experts``) train as one
process holding every expert does: loss curve, pre-clip gradient norms (clipping binds on every step), final
weights; with ``output_router_logits`` the router's balance loss (``disttrain.models.hf.balance``) enters training
as in ``transformers``' own loss, over the step's whole batch.

Plain SGD without momentum, so a wrong gradient anywhere (an expert's rows sent to the wrong rank, a gradient scaled
twice or not summed over the ranks whose tokens an expert computed) moves the weights by it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from disttrain.config import validate  # noqa: E402
from disttrain.errors import ConfigError  # noqa: E402
from tests.test_hf_models import LOSS_RTOL, WEIGHT_ATOL, hf_overrides  # noqa: E402
from tests.test_moe_config import HF_TINY, hf_moe_overrides  # noqa: E402
from tests.test_parity import FAMILIES, check_against, run_summary  # noqa: E402

LAYOUTS = {
    "ep2": (["parallel=zero3", "parallel.ep=2"], 2),
    "ep2xdp_shard2": (["parallel=zero3", "parallel.ep=2"], 4),
    "ddp": (["parallel=ddp"], 2),
    "ep2+accumulation": (["parallel=zero3", "parallel.ep=2", "batch.micro_size=2"], 2),
}
ACCUMULATION = {"ep2+accumulation": ["batch.micro_size=4"]}
"""The one-process reference of a layout that accumulates: the same micro-batches, whole on one rank."""
# measured (fp32, gloo) over the cases below: losses within 2.1e-7 relative of one process, pre-clip norms within
# 7.2e-7, final weights within 1.2e-7 absolute; a gradient scaled wrongly or a balance loss of one rank's batch moves
# them by 3e-5 or more
NORM_RTOL = 2e-6


BALANCE = {"output_router_logits": True, "router_aux_loss_coef": 0.1}
"""The router's balance loss on, weighted so that a wrong one (one rank's batch instead of the step's, or none)
moves the curve far beyond the tolerance."""


MORE = {"qwen2_moe": {**HF_TINY, "num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64},
        "deepseek_v3": {**HF_TINY, "num_key_value_heads": 4, "n_routed_experts": 4, "moe_intermediate_size": 32,
                        "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1, "q_lora_rank": 32,
                        "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16}}
"""Qwen2-MoE (with its gated shared expert) and DeepSeek-V3 (a dense first layer, then 4 routed experts and a shared
one, sigmoid routing), as tiny as ``HF_MOE``'s."""


def mixture(arch: str, balance: bool) -> list[str]:
    """The overrides of a tiny ``arch`` mixture trained with SGD and clipping, with or without its balance loss."""
    extra = BALANCE if balance else {}
    if arch in MORE:
        return [*hf_overrides(arch, {**MORE[arch], **extra}), *FAMILIES["sgd+clip"]]
    return [*hf_moe_overrides(arch, extra), *FAMILIES["sgd+clip"]]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One process per architecture and balance loss, run when first asked for."""
    runs: dict[tuple[str, bool, tuple[str, ...]], dict] = {}

    def reference(arch: str, balance: bool, extra: tuple[str, ...] = ()) -> dict:
        if (arch, balance, extra) not in runs:
            runs[arch, balance, extra] = run_summary(tmp_path_factory.mktemp(arch), [*mixture(arch, balance), *extra])
        return runs[arch, balance, extra]

    return reference


def check_layout(tmp_path, references, arch: str, layout: str, balance: bool) -> None:
    overrides, ranks = LAYOUTS[layout]
    got = run_summary(tmp_path / "run", [*mixture(arch, balance), *overrides, f"trainer.devices={ranks}"])
    reference = references(arch, balance, tuple(ACCUMULATION.get(layout, ())))
    check_against(reference, got, clipped=True, loss_rtol=LOSS_RTOL, weight_atol=WEIGHT_ATOL, norm_rtol=NORM_RTOL)


@pytest.mark.parametrize(("arch", "layout", "balance"), [
    ("mixtral", "ep2", False), ("qwen3_moe", "ep2", True), ("mixtral", "ddp", True),
    ("mixtral", "ep2+accumulation", True)])
def test_hf_mixture_under_expert_parallelism_matches_one_process(tmp_path, references, arch, layout, balance):
    check_layout(tmp_path, references, arch, layout, balance)


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "layout", "balance"), [
    ("qwen3_moe", "ep2", False), ("mixtral", "ep2", True), ("mixtral", "ep2xdp_shard2", True),
    ("qwen2_moe", "ep2", True), ("deepseek_v3", "ep2", False)])
def test_hf_mixture_matches_one_process_in_more_layouts(tmp_path, references, arch, layout, balance):
    check_layout(tmp_path, references, arch, layout, balance)


def test_hf_models_without_grouped_experts_are_refused_in_one_line(make_config):
    """A dense model (its config declares no ``base_model_ep_plan``) and an ep that does not divide the experts."""
    from tests.test_hf_models import ARCHS

    degrees = ["parallel=zero3", "parallel.ep=2", "trainer.devices=2"]
    with pytest.raises(ConfigError, match=r"^parallel\.ep=2 is invalid: 1 for model hf \(llama\): expert parallelism "
                                          r"splits grouped experts.*base_model_ep_plan names, and llama names none"
                       ) as raised:
        validate(make_config([*hf_overrides("llama", ARCHS["llama"]), *degrees]))
    assert "\n" not in str(raised.value)
    # the count is named by the config's own field, the key the user sets it by
    for arch, field in (("mixtral", "num_local_experts"), ("qwen2_moe", "num_experts"),
                        ("deepseek_v3", "n_routed_experts")):
        model = hf_overrides(arch, MORE[arch]) if arch in MORE else hf_moe_overrides(arch)
        with pytest.raises(ConfigError, match=rf"^parallel\.ep=3 is invalid: a divisor of model\.{field}=4 \("):
            validate(make_config([*model, "parallel=zero3", "parallel.ep=3", "trainer.devices=3",
                                  "batch.global_size=9"]))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_the_balance_loss_enters_training_as_in_transformers_own_loss(arch):
    """The gradient of disttrain's cross-entropy of the logits is the gradient of ``transformers``' own loss: the
    cross-entropy plus ``router_aux_loss_coef`` times its ``aux_loss``, weighted as one forward pass of the step."""
    from types import SimpleNamespace

    import torch
    import torch.nn.functional as F

    from disttrain.data.spec import DataSpec
    from disttrain.models.hf import HFConfig, build_hf
    from disttrain.rank.experts import BatchBalanceLoss
    from tests.test_moe_config import HF_MOE

    torch.manual_seed(0)
    net = build_hf(HFConfig(arch=arch, fields={**HF_MOE[arch], **BALANCE}), DataSpec("text", vocab_size=256,
                                                                                    block_size=16))
    net.train()
    # the run's callback with two forward passes per step (accumulation 2), on one process
    BatchBalanceLoss.of(net, forwards_per_step=2).on_fit_start(SimpleNamespace(strategy=None),
                                                              SimpleNamespace(net=net))
    assert net.balance_group is None
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def gradients(loss: torch.Tensor) -> list[torch.Tensor]:
        return [g.clone() for g in torch.autograd.grad(loss, list(net.parameters()))]

    ours = gradients(F.cross_entropy(net(inputs).flatten(0, 1), targets.flatten()))
    output = net._model(input_ids=inputs, use_cache=False)
    cross_entropy = F.cross_entropy(output.logits.flatten(0, 1), targets.flatten())
    theirs = gradients(cross_entropy + 0.5 * net._model.router_aux_loss_coef * output.aux_loss)
    without = gradients(F.cross_entropy(net._model(input_ids=inputs, use_cache=False).logits.flatten(0, 1),
                                        targets.flatten()))
    router = [i for i, (name, _) in enumerate(net.named_parameters()) if name.endswith("gate.weight")]
    assert max(float((without[i] - theirs[i]).abs().max()) for i in router) > 1e-3  # the balance loss matters
    for mine, expected in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine, expected, rtol=0, atol=1e-6)


def test_a_model_without_a_balance_loss_or_a_pipeline_is_refused_output_router_logits(make_config):
    """DeepSeek-V3 routes without a balance loss; pipeline stages do not run the forward that computes one."""
    deepseek = {**MORE["deepseek_v3"], "output_router_logits": True}
    with pytest.raises(ConfigError, match=r"^model\.output_router_logits=true is invalid: false "
                                          r"\(\+model\.output_router_logits=false\): DeepseekV3ForCausalLM defines no "
                                          r"router balance loss$"):
        validate(make_config(hf_overrides("deepseek_v3", deepseek)))
    with pytest.raises(ConfigError, match=r"^parallel\.pp=2 is invalid: 1 for model hf with its router balance loss"):
        validate(make_config([*hf_moe_overrides("mixtral", BALANCE), "parallel=pipeline", "trainer.devices=2"]))


def test_a_rank_that_receives_no_rows_still_gives_its_experts_gradients():
    """A rank whose experts no token chose computes nothing, yet its experts' weights get (zero) gradients, so every
    rank of the ep group reduces them; with the per-expert loop of the ``eager`` implementation too, which alone
    leaves them without one."""
    import torch
    import transformers

    from disttrain.models.hf.experts import _local_experts, grouped_experts, take_expert_parallel
    from tests.test_moe_config import HF_MOE

    config = transformers.AutoConfig.for_model("mixtral", vocab_size=256, **HF_MOE["mixtral"])
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager")
    take_expert_parallel(model)
    experts = list(grouped_experts(model).values())
    assert len(experts) == 2 and all(e.n_experts == 4 and e.expert_parallel is None for e in experts)
    module = experts[0]
    local = {name: param[:2] for name, param in module.named_parameters(recurse=False)}  # 2 of the 4 experts
    rows = torch.zeros(0, 64, requires_grad=True)
    out = _local_experts(module, local, rows, torch.zeros(2, dtype=torch.int64))
    assert out.shape == (0, 64) and module.num_experts == 4 and module.gate_up_proj.shape[0] == 4
    out.sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in module.parameters(recurse=False))
