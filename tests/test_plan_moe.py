"""The planner on mixtures of experts (``model=moe``) and expert parallelism (``parallel.ep``): parameter counts,
FLOPs, state per rank and all-to-all bytes against the formulas of the design (the expert-parallel runtime lives
elsewhere), activations against a measured CPU pass, ``parallel=auto``'s choice and ``mode=plan``'s report."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from omegaconf import OmegaConf

from disttrain.config.typed import model_typed
from disttrain.data.spec import DataSpec, example_batch
from disttrain.models import MODELS, build_model
from disttrain.parallel.activation_checkpoint import apply_activation_checkpointing
from disttrain.parallel.config import ParallelConfig
from disttrain.plan.auto import candidate_layouts
from disttrain.plan.experts import balanced_counts
from disttrain.plan.hardware import PROFILES
from disttrain.plan.layout import Layout
from disttrain.plan.measure import measured_activations
from disttrain.plan.planner import choose_parallel, plan_inputs
from disttrain.plan.report import render

TEXT = DataSpec("text", vocab_size=96, block_size=64)
MOE = {"name": "moe", "flavour": "micro"}
"""2 layers of width 32 (4 query heads, 2 key/value heads of 8), 8 experts of hidden width 48, 2 per token."""
V, T, L, C, KV, E, K, H = 96, 64, 2, 32, 16, 8, 2, 48
ATTENTION = 2 * C * C + 2 * C * KV  # q and o; k and v for 2 key/value heads of 8
DENSE_BLOCK = ATTENTION + 2 * C + C * E  # attention, two norms, router
EXPERTS_BLOCK = 3 * E * C * H  # w1, w3 [E, C, H] and w2 [E, H, C]
DENSE = 2 * V * C + C + L * DENSE_BLOCK  # embedding, output, final norm and the blocks' dense parts
EXPERTS = L * EXPERTS_BLOCK
ADAMW = (4, 4, 8)  # fp32 parameter, gradient, two moments: bytes per element


def _model(cfg: dict, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.device(device):
        return build_model(model_typed(OmegaConf.create(cfg), MODELS), TEXT)


def _inputs(net: torch.nn.Module, micro: int = 8, precision: str = "32-true", profile=PROFILES["h100_sxm"]):
    return plan_inputs(net, TEXT, micro, ParallelConfig(), OmegaConf.create({"name": "adamw"}), precision, profile)


def test_total_and_active_parameters_follow_the_formula() -> None:
    """Every parameter counts once in the total; a token meets the dense ones and top_k of each layer's experts."""
    net = _model(MOE)
    stats = _inputs(net).stats
    assert stats.params == DENSE + EXPERTS == sum(p.numel() for p in net.parameters()) == 86688
    assert stats.expert_param_count == EXPERTS
    assert set(stats.expert_params) == {f"layers.{i}.feed_forward.experts.{w}" for i in range(L)
                                        for w in ("w1", "w2", "w3")}
    assert stats.active_params == DENSE + EXPERTS * K / E == net.active_params(non_embedding=False) == 31392
    assert [(c.unit, c.rows, c.in_bytes, c.out_bytes) for c in stats.expert_calls] == [
        (f"layers.{i}", 8 * T * K, 8 * T * K * C * 4, 8 * T * K * C * 4) for i in range(L)]


def test_a_mixtral_sized_model_has_its_published_sizes() -> None:
    """Mixtral 8x7B (32 layers of width 4096, 8 experts of 14336, 2 per token, 32000 tokens): 46.7B parameters,
    12.9B of them active per token, as its model card counts them; measured on the meta device."""
    spec = DataSpec("text", vocab_size=32000, block_size=64)
    cfg = {"name": "moe", "n_layer": 32, "n_head": 32, "n_kv_head": 8, "n_embd": 4096, "n_experts": 8, "top_k": 2,
           "expert_hidden": 14336, "block_size": 64}
    with torch.device("meta"):
        net = build_model(model_typed(OmegaConf.create(cfg), MODELS), spec)
    stats = plan_inputs(net, spec, 1, ParallelConfig(), None, "bf16-mixed", PROFILES["h100_sxm"]).stats
    assert round(stats.params / 1e8) == 467 and round(stats.active_params / 1e8) == 129
    assert stats.active_params == net.active_params(non_embedding=False)


@pytest.mark.parametrize("hidden", [48, 10], ids=["grouped_mm", "one_product_per_expert"])
def test_the_experts_flops_are_those_of_the_routed_rows(hidden: int) -> None:
    """Going from top_k 1 to 2 adds one row per token to each layer's three expert products (2 x rows x C x H FLOPs
    each in forward, twice that in backward), whichever kernel runs them: ``torch._grouped_mm`` (16-byte-aligned
    widths; torch's counter leaves it out) or one product per expert (width 10)."""
    micro = 4
    flops = {k: _inputs(_model({**MOE, "top_k": k, "expert_hidden": hidden}), micro).stats for k in (1, 2)}
    extra_rows = micro * T
    forward = L * 3 * 2 * extra_rows * C * hidden
    assert sum(flops[2].forward_flops.values()) - sum(flops[1].forward_flops.values()) == forward
    assert flops[2].total_flops - flops[1].total_flops == 3 * forward


def test_routing_runs_on_the_meta_device_as_balanced_routing() -> None:
    """bincount's counts, copied off the meta device (the per-expert products split rows by them), are balanced;
    a capacity factor drops nothing there (its boolean masks keep every row)."""
    assert balanced_counts(10, 4) == [3, 3, 2, 2] and sum(balanced_counts(128, 8)) == 128
    stats = _inputs(_model({**MOE, "expert_hidden": 10, "capacity_factor": 0.5}, "meta"), 2).stats
    assert [c.rows for c in stats.expert_calls] == [2 * T * K] * L


def test_a_count_the_plan_cannot_size_is_refused_by_name() -> None:
    """Under BalancedRouting a routing-shaped bincount has its balanced bins; a weighted one or one without
    ``minlength`` has no size without its values, and is refused rather than guessed."""
    from disttrain.plan.experts import BalancedRouting

    values = torch.empty(12, dtype=torch.int64, device="meta")
    with BalancedRouting():
        assert torch.bincount(values, minlength=4).to("cpu").tolist() == [3, 3, 3, 3]
        for call in ({"weights": torch.empty(12, device="meta"), "minlength": 4}, {}):
            with pytest.raises(ValueError, match="only as routing calls it"):
                torch.bincount(values, **call)


def _expected_state(ep: int, zero_stage: int, shard: int = 4) -> dict[str, float]:
    """Per-rank state of dense parameters sharded over ``shard`` ranks and experts split over ep, each sharded over
    shard / ep ranks (ZeRO-3: shards only; ZeRO-2: whole local parameters beside their shards)."""
    param, grad, optim = ADAMW
    own = DENSE + EXPERTS / ep  # whole parameters a rank uses
    shards = DENSE / shard + EXPERTS / ep / (shard // ep)
    params = shards * param if zero_stage == 3 else own * param + shards * param
    return {"params": params, "grads": shards * grad, "optimizer": shards * optim}


@pytest.mark.parametrize("ep", [1, 2, 4])
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_state_per_rank_under_expert_parallelism(ep: int, zero_stage: int) -> None:
    """dp_shard=4: dense state over 4 ranks; experts over ep x (4 / ep). Under ZeRO-3 the shards are the same at
    every ep; what ep changes is what a rank gathers whole: its unit's dense parameters and its 1/ep of the
    experts (twice, an all-gather's output too, plus that unit's gradients; under ZeRO-2 the gradients beside the
    later unit's reduce-scatter input), and under ZeRO-2 the whole parameters it keeps."""
    inputs = _inputs(_model(MOE))
    e = inputs.estimate(Layout(dp_shard=4, ep=ep, zero_stage=zero_stage, micro_size=8))
    for term, value in _expected_state(ep, zero_stage).items():
        assert e.memory[term] == pytest.approx(value), term
    block = DENSE_BLOCK + EXPERTS_BLOCK / ep
    if zero_stage == 3:  # the block gathered, an all-gather's output, its gradients; the root gathered, the output's
        expected = (2 * 4 + 4) * block + (2 * V * C + C + V * C) * 4
    else:  # the first block's gradients beside the later one's reduce-scatter input
        expected = 2 * 4 * block
    assert e.memory["transient"] == pytest.approx(expected)
    if zero_stage == 3:
        assert e.memory["params"] == pytest.approx((DENSE + EXPERTS) * 4 / 4)
    # unsharded accumulation holds every gradient whole: the rank's own experts only
    whole = inputs.estimate(Layout(dp_shard=4, ep=ep, zero_stage=zero_stage, micro_size=4, accumulation=2,
                                   accumulate_grads="unsharded"))
    assert whole.memory["grads"] == pytest.approx((DENSE + EXPERTS / ep) * 4)
    # the report's table gives the same figures at each ep, from any layout of the same degrees
    row = inputs.estimate(Layout(dp_shard=4, ep=1, zero_stage=zero_stage, micro_size=8)).by_ep[ep]
    assert row["params"] == pytest.approx(e.memory["params"]) and row["peak"] == pytest.approx(e.total_bytes)


@pytest.mark.parametrize(("ep", "cp", "policy", "precision"), [
    (2, 1, "none", "32-true"), (4, 1, "none", "32-true"), (2, 1, "full", "32-true"), (4, 1, "full", "32-true"),
    (2, 2, "selective", "32-true"), (2, 1, "none", "bf16-mixed"), (4, 1, "none", "bf16-mixed")])
def test_all_to_all_bytes_per_step_follow_the_formula(ep: int, cp: int, policy: str, precision: str) -> None:
    """Per MoE layer and micro-batch: rows out to the experts and back in forward, their gradients both ways in
    backward, and a checkpointed block's forward again (2 more); each moves tokens per rank x top_k x C x 4 bytes
    (the rows stay fp32 under bf16-mixed: they are the normalised residual stream), of which a rank sends
    (ep - 1) / ep. Each forward first swaps the rows' counts (E integers). The experts' FSDP gathers and
    reduce-scatters run over dp_shard / ep x cp ranks."""
    micro, accumulation, dp_shard = 8, 2, 4 // cp
    layout = Layout(dp_shard=dp_shard, cp=cp, ep=ep, zero_stage=3, micro_size=micro, accumulation=accumulation,
                    activation_checkpoint=policy)
    e = _inputs(_model(MOE), micro, precision).estimate(layout)
    rows = next(c for c in e.collectives if c.what == "token rows")
    exchanges = 4 + (2 if policy != "none" else 0)
    buffer = exchanges * L * accumulation * (micro * T // cp) * K * C * 4
    assert (rows.kind, rows.group, rows.size, rows.calls) == ("all_to_all", "ep", ep, exchanges * L * accumulation)
    assert rows.buffer_bytes == pytest.approx(buffer)
    assert rows.sent_bytes == pytest.approx((ep - 1) / ep * buffer)
    counts = next(c for c in e.collectives if c.what == "row counts")
    forwards = 2 if policy != "none" else 1  # the counts go once per forward, before the rows
    assert counts.calls == forwards * L * accumulation and counts.buffer_bytes == counts.calls * E * 8
    fsdp = {(c.kind, c.group): c for c in e.collectives if c.group.startswith("dp_shard")}
    expert_group, expert_ranks = ("dp_shard_mod_ep_cp" if cp > 1 else "dp_shard_mod_ep"), dp_shard * cp // ep
    gather_bytes = 2 if precision.startswith("bf16") else 4  # FSDP2 gathers bf16 copies on a GPU under bf16-mixed
    if expert_ranks > 1:
        gather = fsdp["all_gather", expert_group]
        assert gather.size == expert_ranks
        assert gather.buffer_bytes == pytest.approx(EXPERTS / ep * gather_bytes * 2 * accumulation)
    else:  # each expert lives on one rank of the ep group: nothing to gather
        assert not any(group == expert_group for _, group in fsdp)
    dense_group = "dp_shard_cp" if cp > 1 else "dp_shard"
    assert fsdp["all_gather", dense_group].buffer_bytes == pytest.approx(DENSE * gather_bytes * 2 * accumulation)
    assert not any(c.group == "ep" for c in _inputs(_model(MOE), micro, precision).estimate(
        replace(layout, ep=1)).collectives)


def test_auto_considers_ep_for_experts_only_and_takes_it_where_only_split_experts_fit() -> None:
    """Candidates: ep over the divisors of dp_shard dividing the experts, under ZeRO-2/3, for model=moe; never
    for a dense model. With 25 MB per device the 3.2M-parameter mixture of 16 wide experts fits 4 ranks only
    with its experts split (ZeRO-3 at ep=1 would gather a layer's 6.3 MB of experts twice over, and
    ZeRO-2 keep them all whole)."""
    moe = _inputs(_model(MOE, "meta"), 1)
    dense = _inputs(_model({"name": "llama", "flavour": "micro"}, "meta"), 1)
    considered = {(g[0].dp_shard, g[0].zero_stage, g[0].ep) for g in candidate_layouts(4, 8, moe, 4, 8)}
    assert {(4, 3, 1), (4, 3, 2), (4, 3, 4), (4, 2, 4), (2, 2, 2)} <= considered
    assert all(ep == 1 for _, stage, ep in considered if stage < 2)
    assert {g[0].ep for g in candidate_layouts(4, 8, dense, 4, 8)} == {1}
    wide = {**MOE, "n_experts": 16, "expert_hidden": 1024, "top_k": 1}
    tight = replace(PROFILES["h100_sxm"], memory_bytes=25e6)
    optim = OmegaConf.create({"name": "adamw"})
    layout, why = choose_parallel(_model(wide, "meta"), TEXT, 4, 8, ParallelConfig(), optim, "bf16-mixed", tight)
    assert layout.ep > 1 and f"chose dp_shard={layout.dp_shard} ep={layout.ep}" in why, why
    layout, why = choose_parallel(_model({"name": "llama", "flavour": "micro"}, "meta"), TEXT, 4, 8,
                                  ParallelConfig(), optim, "bf16-mixed", PROFILES["h100_sxm"])
    assert layout.ep == 1 and " ep=" not in why


def test_a_budget_that_only_split_experts_meet_names_the_ep(make_config) -> None:
    """``plan.memory_gb`` on a training run of ZeRO-2 over 4 ranks, whose whole parameters (16 experts of 1024 per
    layer) do not fit 60 MB per rank: the refusal names the ep that would (4; 2 is not enough)."""
    from disttrain.config import validate
    from disttrain.errors import ConfigError

    wide = ["model=moe", "model.flavour=micro", "model.n_experts=16", "model.expert_hidden=1024", "model.top_k=1",
            "data=pydocs", "parallel=zero2", "trainer.devices=4"]
    with pytest.raises(ConfigError, match=r"plan.memory_gb=0.06 is invalid: .*\(dp_shard=4 zero2 micro=16x1\): "
                       r"needs .* per rank of 60 MB .*; fits: parallel.ep=4 or "):
        validate(make_config([*wide, "plan.memory_gb=0.06"]))
    validate(make_config([*wide, "parallel.ep=4", "plan.memory_gb=0.06"]))


@pytest.mark.parametrize(("cfg", "policy"), [(MOE, "none"), (MOE, "full"), ({**MOE, "flavour": "nano"}, "none"),
                                             ({**MOE, "flavour": "nano"}, "full")],
                         ids=["micro-none", "micro-full", "nano-none", "nano-full"])
def test_activations_are_within_10_percent_of_a_measured_cpu_pass(cfg: dict, policy: str) -> None:
    """16 sequences of 64 tokens on one process (ep=1; the rows a rank keeps under ep are as many). Measured here
    (predicted / measured, ``measured_activations``; real routing, not balanced: the rows are tokens x top_k
    either way): held after forward 1.000 for both models and policies, peak in backward 0.96-0.99. Selective
    checkpointing is left out: the mixture's step statistics (``MoEFeedForward._record``) take another branch
    when the checkpoint recomputes the forward, which torch refuses."""
    net = _model(cfg)
    e = _inputs(net, 16).estimate(Layout(micro_size=16, activation_checkpoint=policy))
    if policy != "none":
        apply_activation_checkpointing(net, policy=policy)
    held, peak = measured_activations(net, example_batch(TEXT, 16))
    assert e.activations_held == pytest.approx(held, rel=0.01)
    assert e.memory["activations"] == pytest.approx(peak, rel=0.1)


def test_expert_parallelism_adds_the_receive_buffer_to_the_peak_and_leaves_tp_the_mixture_whole() -> None:
    """Under ep a mixture's backward receives its rows' gradients beside those it sends (one rows buffer on the
    peak); under tp the attention's activations and work split, the mixture's do not."""
    inputs = _inputs(_model(MOE))
    plain = inputs.estimate(Layout(dp_shard=4, zero_stage=3, micro_size=8, activation_checkpoint="full"))
    split = inputs.estimate(Layout(dp_shard=4, ep=2, zero_stage=3, micro_size=8, activation_checkpoint="full"))
    assert split.activations_held == plain.activations_held
    assert split.memory["activations"] == pytest.approx(plain.memory["activations"] + 8 * T * K * C * 4)
    stats = inputs.stats
    mixture = sum(b["saved"] for b in stats.mixture_bytes.values())
    assert 0 < mixture < stats.activation_bytes
    tp = inputs.estimate(Layout(tp=2, dp_shard=2, zero_stage=3, micro_size=8))
    whole = inputs.estimate(Layout(dp_shard=2, zero_stage=3, micro_size=8))
    blocks = sum(stats.saved_bytes[f"layers.{i}"] for i in range(L))
    mixture_blocks = sum(stats.mixture_bytes[f"layers.{i}"]["saved"] for i in range(L))
    split_share = (10 + 24 / 2) / 34
    assert whole.activations_held - tp.activations_held == pytest.approx((blocks - mixture_blocks) * (1 - split_share))


def test_plan_mode_shows_the_experts_and_each_ep(tmp_path) -> None:
    """``mode=plan model=moe`` on 4 ranks at ep=2: the parameters a token uses, a row per ep with the state per
    rank and the all-to-all bytes, and the collectives over ep."""
    from tests.conftest import train_cli_in_process as train_cli

    plan = train_cli(["mode=plan", "model=moe", "data=pydocs", "parallel=zero3", "parallel.ep=2",
                      "trainer.devices=4", "plan.profile=h100_sxm", "trainer.precision=32-true",
                      f"hydra.run.dir={tmp_path}"], tmp_path)
    assert plan.returncode == 0, plan.stderr
    out = plan.stdout
    assert "plan: moe (2.43M parameters, 0.8081M active per token) on 4 rank(s): dp_shard=4 ep=2 zero3" in out
    assert "experts: 4 mixture layer(s) of 8 experts, 2 per token (planned as balanced routing)" in out
    assert "| ep | parameters | gradients | optimiser state | transient | peak | all-to-all sent | FSDP sent |" in out
    for label in ("1", "2 (this run)", "4"):
        assert f"\n| {label} | 2.43 MB | 2.43 MB | 4.86 MB | " in out, label
    assert "| all_to_all (token rows) | ep | 2 | 16.8 MB | 16 | 8.39 MB |" in out
    assert "| all_gather | dp_shard_mod_ep | 2 |" in out
    written = json.loads((tmp_path / "plan.json").read_text())
    assert written["layout"]["ep"] == 2 and set(written["by_ep"]) == {"1", "2", "4"}
    assert written["by_ep"]["4"]["fsdp"] < written["by_ep"]["2"]["fsdp"] < written["by_ep"]["1"]["fsdp"]


def test_a_dense_model_shows_no_expert_lines() -> None:
    inputs = _inputs(_model({"name": "llama", "flavour": "micro"}))
    e = inputs.estimate(Layout(dp_shard=4, zero_stage=3, micro_size=8))
    assert e.by_ep == {} and not inputs.stats.has_experts and inputs.stats.active_params == inputs.stats.params
    assert "expert" not in render(e, PROFILES["h100_sxm"], inputs.stats.params, "llama", inputs.stats)
