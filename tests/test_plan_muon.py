"""The planner's price of ``optim=muon``: state bytes per rank (momentum for the matrices, AdamW's moments for the
rest), the gathers of split matrices and the Newton-Schulz FLOPs, against real ranks and hand formulas."""

from __future__ import annotations

import pytest
import torch

from disttrain.data.spec import DataSpec
from disttrain.optim.muon import MuonConfig, orthogonalise
from disttrain.parallel.config import ParallelConfig
from disttrain.plan.hardware import PROFILES
from disttrain.plan.layout import Layout
from disttrain.plan.matrix_step import newton_schulz_flops
from disttrain.plan.planner import plan_inputs
from tests.dist_utils import run_on_ranks, sent_bytes_during

SPEC = DataSpec("text", vocab_size=256, block_size=32)
LAYOUTS = {"zero3": Layout(dp_shard=2, zero_stage=3), "tp": Layout(tp=2)}
# GPT(2 layers, width 64, vocab 256): per block q, k, v, proj (64 x 64) and fc, proj (64 x 256) go to Muon
MATRIX_ELEMENTS = 2 * (4 * 64 * 64 + 2 * 64 * 256)


def _gpt(device: str = "cpu") -> torch.nn.Module:
    from disttrain.models.gpt import GPT, GPTDims

    torch.manual_seed(0)
    with torch.device(device):
        return GPT(GPTDims(2, 4, 64, 32, 256), tie_weights=True)


def _plan(layout: str, ns_dtype: str = "float32", per_head: bool = False):
    inputs = plan_inputs(_gpt("meta"), SPEC, 1, ParallelConfig(), MuonConfig(ns_dtype=ns_dtype, per_head=per_head),
                         "32-true", PROFILES["h100_sxm"])
    return inputs.estimate(LAYOUTS[layout])


def _muon_rank(layouts: list[str], per_head: bool = False) -> list[tuple[int, int | None, int]]:
    """Per layout: the bytes of the Muon optimiser's state this rank holds after a step of the tiny GPT, read from
    the tensors (the scalar step counters left out), the bytes all ranks wrote during a second step, and the bytes
    the optimiser counted itself gathering in that step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from disttrain.optim.muon import build_muon
    from disttrain.parallel.fsdp import apply_fsdp
    from disttrain.parallel.tp import apply_tp

    out = []
    for layout in layouts:
        model, mesh = _gpt(), init_device_mesh("cpu", (2,))
        module = apply_fsdp(model, mesh, reshard_after_forward=True) if layout == "zero3" else \
            apply_tp(model, mesh, model.tp_plan())
        params = list(module.parameters())
        for p in params:
            p.grad = torch.ones_like(p)
        opt = build_muon(MuonConfig(ns_dtype="float32", per_head=per_head), module)
        opt.step()
        state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
        held = sum((v.to_local() if isinstance(v, DTensor) else v).numel() * v.element_size() for v in state)
        before = opt.gathered_bytes
        out.append((held, sent_bytes_during(opt.step), opt.gathered_bytes - before))
    return out


def test_state_and_gathers_match_two_ranks() -> None:
    """ZeRO-3 and tp=2: the planned optimiser state per rank is what the ranks' Muon holds, to the byte; the
    gathers of whole matrices are the hand formula (each rank sends half of every matrix, in fp32) and what the
    ranks wrote during a step (gloo's barriers add a little), and equal, on each rank, what the optimiser counted
    itself gathering (what the run's ``exchange:`` line reports)."""
    layouts = list(LAYOUTS)
    ranks = run_on_ranks(_muon_rank, 2, layouts, timeout=240)
    for i, layout in enumerate(layouts):
        est = _plan(layout)
        held = max(rank[i][0] for rank in ranks)
        assert est.memory["optimizer"] == pytest.approx(held, abs=0.5), (layout, est.memory["optimizer"], held)
        gathers = [c for c in est.collectives if c.what == "whole matrices"]
        assert [(c.group, c.size, c.calls) for c in gathers] == [("dp_shard" if layout == "zero3" else "tp", 2, 12)]
        assert gathers[0].sent_bytes == MATRIX_ELEMENTS * 4 / 2
        assert all(rank[i][2] == gathers[0].sent_bytes for rank in ranks), (layout, [rank[i][2] for rank in ranks])
        sent = ranks[0][i][1]
        if sent is not None:
            assert sent == pytest.approx(2 * gathers[0].sent_bytes, rel=0.05), (layout, sent)


def test_per_head_gathers_and_flops_match_two_ranks() -> None:
    """``optim.per_head``: a shard holding whole heads is stepped where it lies, so ZeRO-3 gathers only the output
    projections (whose rows cut every head) and the MLP, tensor parallelism only the MLP: the plan's gathers equal
    what each rank's Muon counted gathering; the iteration's FLOPs are the heads' matrices (of 16 x 64), of the
    rank's own heads where it holds whole ones."""
    ranks = run_on_ranks(_muon_rank, 2, list(LAYOUTS), True, timeout=240)
    mlp = 2 * 2 * 64 * 256  # per layer fc and proj, two layers
    gathered = {"zero3": (mlp + 2 * 64 * 64) * 4 / 2, "tp": mlp * 4 / 2}
    head = newton_schulz_flops(16, 64, 5)
    hand = {"zero3": 2 * (3 * 2 * head + 4 * head + 2 * newton_schulz_flops(64, 256, 5)),
            "tp": 2 * (4 * 2 * head + 2 * newton_schulz_flops(64, 256, 5))}
    for i, layout in enumerate(LAYOUTS):
        est = _plan(layout, per_head=True)
        planned = sum(c.sent_bytes for c in est.collectives if c.what == "whole matrices")
        assert planned == gathered[layout], (layout, planned)
        assert all(rank[i][2] == planned for rank in ranks), (layout, [rank[i][2] for rank in ranks])
        assert est.orthogonalise_flops == hand[layout], (layout, est.orthogonalise_flops, hand[layout])


def test_state_bytes_are_momentum_for_matrices_and_two_moments_for_the_rest() -> None:
    """One rank: the planned optimiser state is the real optimiser's on the real model (adamw's 8 bytes per value
    would overstate it), and no gather is planned."""
    from disttrain.optim.muon import build_muon

    model = _gpt()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt = build_muon(MuonConfig(), model)
    opt.step()
    held = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if v.dim())
    inputs = plan_inputs(_gpt("meta"), SPEC, 1, ParallelConfig(), MuonConfig(), "32-true", PROFILES["h100_sxm"])
    est = inputs.estimate(Layout())
    assert est.memory["optimizer"] == held
    assert not [c for c in est.collectives if c.what == "whole matrices"]


def test_newton_schulz_flops_are_the_hand_formula_and_what_torch_counts() -> None:
    """A 64 x 256 matrix, 5 steps: per step X X^T (2 m^2 n), its square (2 m^3), that times X (2 m^2 n) with m = 64,
    n = 256; torch's FLOP counter counts the same products in the iteration; the plan sums them over the
    matrices and times them at the peak rate of the iteration's dtype."""
    from torch.utils.flop_counter import FlopCounterMode

    assert newton_schulz_flops(64, 256, 5) == newton_schulz_flops(256, 64, 5) == 5 * (4 * 64 ** 2 * 256 + 2 * 64 ** 3)
    with FlopCounterMode(display=False) as counter:
        orthogonalise(torch.randn(256, 64), (3.4445, -4.775, 2.0315), 5, 1e-7, torch.float32)
    assert counter.get_total_flops() == newton_schulz_flops(256, 64, 5)
    hand = 8 * newton_schulz_flops(64, 64, 5) + 4 * newton_schulz_flops(64, 256, 5)
    for ns_dtype, rate in (("float32", "fp32"), ("bfloat16", "bf16")):
        for layout in LAYOUTS:  # every rank of the shard group orthogonalises every matrix whole
            est = _plan(layout, ns_dtype)
            assert est.orthogonalise_flops == hand
            assert est.orthogonalise_s == pytest.approx(hand / PROFILES["h100_sxm"].flops[rate])


def test_plan_mode_prints_the_orthogonalisation(tmp_path) -> None:
    """``mode=plan optim=muon`` prints the iteration's FLOPs and share of the step, and its gathers."""
    from tests.conftest import train_cli_in_process as train_cli

    plan = train_cli(["mode=plan", "model=gpt", "data=pydocs", "optim=muon", "parallel=zero3", "trainer.devices=2",
                      "plan.profile=h100_sxm", f"hydra.run.dir={tmp_path / 'plan'}"], tmp_path)
    assert plan.returncode == 0, plan.stderr
    line = next(x for x in plan.stdout.splitlines() if x.startswith("orthogonalisation"))
    assert "GFLOP" in line and "% of the step" in line
    assert "| all_gather (whole matrices) | dp_shard | 2 |" in plan.stdout



def test_auto_weighs_the_orthogonalisation_and_the_state() -> None:
    """``parallel=auto`` estimates every candidate with Muon's state, gathers and iteration: a sharded candidate
    carries the gathers, every candidate the FLOPs, and the state is AdamW's less 4 bytes per matrix value."""
    from omegaconf import OmegaConf

    from disttrain.plan.auto import choose

    inputs = plan_inputs(_gpt("meta"), SPEC, 1, ParallelConfig(), MuonConfig(), "32-true", PROFILES["h100_sxm"])
    adamw = plan_inputs(_gpt("meta"), SPEC, 1, ParallelConfig(), OmegaConf.create({"name": "adamw"}), "32-true",
                        PROFILES["h100_sxm"])
    choice = choose(inputs, 2, 8, len(inputs.stats.pipeline_units))
    assert choice.best is not None and all(e.orthogonalise_flops > 0 for e in choice.ranked)
    for e in choice.ranked:
        saved = 4 * MATRIX_ELEMENTS / e.layout.tp / e.layout.state_shards  # every matrix is split by tp here
        if e.layout.pp == 1:
            assert e.memory["optimizer"] == pytest.approx(adamw.estimate(e.layout).memory["optimizer"] - saved)
        assert any(c.what == "whole matrices" for c in e.collectives) == (e.layout.shards_parameters or e.layout.tp > 1)


@pytest.mark.parametrize(("layout", "overrides"), [("zero3", ["parallel=zero3"]), ("tp", ["parallel=tp"])])
def test_run_reports_the_gathers_the_plan_prices(tmp_path, capfd, layout, overrides) -> None:
    """A 2-rank run counts the bytes Muon gathers per step into ``results.json`` and its ``exchange:`` line (beside
    ZeRO-3's gradient exchange; alone under tensor parallelism, whose exchange is not measured), equal to the
    plan's figure for that layout."""
    import json

    from disttrain.launch.job import train
    from disttrain.models.gpt import GPT, GPTDims
    from tests.conftest import compose_config
    from tests.test_run import GPT_FAST

    train(compose_config([*GPT_FAST, "trainer.max_steps=3", "optim=muon", *overrides, "trainer.devices=2"],
                         tmp_path))
    comm = json.loads((tmp_path / "results.json").read_text())["comm"]
    with torch.device("meta"):  # GPT micro; the matrices do not depend on the vocabulary
        net = GPT(GPTDims(2, 2, 32, 32, 256))
    inputs = plan_inputs(net, SPEC, 1, ParallelConfig(), MuonConfig(), "32-true", PROFILES["h100_sxm"])
    planned = sum(c.sent_bytes for c in inputs.estimate(LAYOUTS[layout]).collectives if c.what == "whole matrices")
    assert planned > 0 and comm["matrix_gather_bytes_per_step"] == planned, (comm, planned)
    line = next(x for x in capfd.readouterr().out.splitlines() if x.startswith("  exchange:"))
    assert f"whole-matrix gathers {round(planned):,} bytes per rank and step (counted)" in line, line
    gradients = f"  exchange: {comm['bytes_sent_per_step']:,} bytes" if layout == "zero3" else "  exchange: whole"
    assert line.startswith(gradients), line
