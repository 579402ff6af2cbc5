"""The planner's price of ``optim=soap``: state bytes per rank (L, R, QL, QR and both moments of every matrix, whole
on each rank of its shard group, AdamW's moments for the rest), the gathers of split matrices' gradients and the
FLOPs of the rotations and eigendecompositions, against real ranks and hand formulas."""

from __future__ import annotations

import pytest
import torch

from disttrain.optim.soap import Soap, SoapConfig
from disttrain.parallel.config import ParallelConfig
from disttrain.plan.hardware import PROFILES
from disttrain.plan.layout import Layout
from disttrain.plan.matrix_step import EIGH_FLOPS, soap_flops, soap_values
from disttrain.plan.planner import plan_inputs
from tests.dist_utils import run_on_ranks, sent_bytes_during
from tests.test_plan_muon import LAYOUTS, MATRIX_ELEMENTS, SPEC, _gpt

# GPT(2 layers, width 64, vocab 256): per block q, k, v, proj (64 x 64), fc (256 x 64) and proj (64 x 256)
SHAPES = 2 * [(64, 64)] * 4 + 2 * [(256, 64), (64, 256)]


def _plan(layout: Layout, dtype: str = "float64", frequency: int = 10):
    inputs = plan_inputs(_gpt("meta"), SPEC, 1, ParallelConfig(), SoapConfig(precondition_dtype=dtype,
                         precondition_frequency=frequency), "32-true", PROFILES["h100_sxm"])
    return inputs.estimate(layout)


def _held(opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimiser's state tensors on this rank (the scalar step counters left out)."""
    from torch.distributed.tensor import DTensor

    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    return sum((v.to_local() if isinstance(v, DTensor) else v).numel() * v.element_size() for v in state)


def _soap_rank(layouts: list[str], dtype: str) -> list[tuple[int, int | None]]:
    """Per layout: the bytes of SOAP's state this rank holds after a step of the tiny GPT, and the bytes all ranks
    wrote during a second step (no basis refresh in it)."""
    from torch.distributed.device_mesh import init_device_mesh

    from disttrain.optim.soap import build_soap
    from disttrain.parallel.fsdp import apply_fsdp
    from disttrain.parallel.tp import apply_tp

    out = []
    for layout in layouts:
        model, mesh = _gpt(), init_device_mesh("cpu", (2,))
        module = apply_fsdp(model, mesh, reshard_after_forward=True) if layout == "zero3" else \
            apply_tp(model, mesh, model.tp_plan())
        for p in module.parameters():
            p.grad = torch.ones_like(p)
        opt = build_soap(SoapConfig(precondition_dtype=dtype), module)
        opt.step()
        out.append((_held(opt), sent_bytes_during(opt.step)))
    return out


@pytest.mark.parametrize("dtype", ["float64", pytest.param("float32", marks=pytest.mark.slow)])
def test_state_and_gathers_match_two_ranks(dtype) -> None:
    """ZeRO-3 and tp=2: the planned optimiser state per rank is what the ranks' SOAP holds, to the byte (every
    matrix's state whole on both ranks); the gathers of the matrices' gradients are the hand formula (each rank
    sends half of every matrix, in fp32) and what the ranks wrote during a step (gloo's barriers add a little)."""
    layouts = list(LAYOUTS)
    ranks = run_on_ranks(_soap_rank, 2, layouts, dtype, timeout=240)
    for i, layout in enumerate(layouts):
        est = _plan(LAYOUTS[layout], dtype)
        held = max(rank[i][0] for rank in ranks)
        assert est.memory["optimizer"] == pytest.approx(held, abs=0.5), (layout, est.memory["optimizer"], held)
        gathers = [c for c in est.collectives if c.what == "whole matrices"]
        assert [(c.group, c.size, c.calls) for c in gathers] == [("dp_shard" if layout == "zero3" else "tp", 2, 12)]
        assert gathers[0].sent_bytes == MATRIX_ELEMENTS * 4 / 2
        sent = ranks[0][i][1]
        if sent is not None:
            assert sent == pytest.approx(2 * gathers[0].sent_bytes, rel=0.05), (layout, sent)


def test_state_bytes_on_one_rank_and_under_zero1() -> None:
    """One rank: the planned state is the real optimiser's on the real model, to the byte (the preconditioners'
    rows^2 + cols^2 dwarf AdamW's 8 bytes per value here), and no gather is planned. ZeRO-1: each matrix's state on
    its owner only, a 1/dp_shard share of it per rank."""
    from disttrain.optim.soap import build_soap

    model = _gpt()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt = build_soap(SoapConfig(precondition_dtype="float64"), model)
    opt.step()
    est = _plan(Layout())
    assert est.memory["optimizer"] == _held(opt)
    assert sum(soap_values(s) for s in SHAPES) * 8 < _held(opt) < est.memory["optimizer"] + 1
    assert not [c for c in est.collectives if c.what == "whole matrices"]
    zero1 = _plan(Layout(dp_shard=2, zero_stage=1))
    assert zero1.memory["optimizer"] == pytest.approx(_held(opt) / 2)


def test_flops_are_the_hand_formula_and_what_torch_counts() -> None:
    """A 64 x 256 matrix: a step without a refresh is the products torch's FLOP counter counts (rotation in and out,
    G Gᵀ and Gᵀ G: 6 r c (r + c)); a refresh adds the eigendecompositions (9 n^3 each, which the counter does not
    see) and the first moment's rotation (4 r c (r + c)), amortised over precondition_frequency. The plan sums them
    over the matrices, every rank of a shard group computing every matrix."""
    from torch.utils.flop_counter import FlopCounterMode

    rows, cols = 64, 256
    products = 2 * rows * cols * (rows + cols)
    assert soap_flops(rows, cols, 1) == 5 * products + EIGH_FLOPS * (rows ** 3 + cols ** 3)
    assert soap_flops(rows, cols, 10) == pytest.approx(3 * products + (2 * products + EIGH_FLOPS * (
        rows ** 3 + cols ** 3)) / 10)
    weight = torch.nn.Parameter(torch.randn(rows, cols))
    opt = Soap([weight], precondition_frequency=10)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        weight.grad = torch.randn(rows, cols, generator=gen)
        opt.step()
    weight.grad = torch.randn(rows, cols, generator=gen)
    with FlopCounterMode(display=False) as counter:
        opt.step()  # step 3: no refresh
    assert counter.get_total_flops() == 3 * products
    hand = sum(soap_flops(*shape, 10) for shape in SHAPES)
    for name, layout in LAYOUTS.items():
        est = _plan(layout)
        assert est.orthogonalise_flops == pytest.approx(hand), name
        assert est.orthogonalise_s == pytest.approx(hand / PROFILES["h100_sxm"].flops["fp32"])
    assert _plan(Layout(dp_shard=2, zero_stage=1)).orthogonalise_flops == pytest.approx(hand / 2)


def test_plan_mode_prints_the_eigenbases(tmp_path) -> None:
    """``mode=plan optim=soap`` prints the optimiser's FLOPs and share of the step, and its gathers."""
    from tests.conftest import train_cli_in_process as train_cli

    plan = train_cli(["mode=plan", "model=gpt", "data=pydocs", "optim=soap", "parallel=zero3", "trainer.devices=2",
                      "plan.profile=h100_sxm", f"hydra.run.dir={tmp_path / 'plan'}"], tmp_path)
    assert plan.returncode == 0, plan.stderr
    line = next(x for x in plan.stdout.splitlines() if x.startswith("orthogonalisation"))
    assert "SOAP's eigenbases" in line and "GFLOP" in line and "% of the step" in line
    assert "| all_gather (whole matrices) | dp_shard | 2 |" in plan.stdout


def test_per_head_state_bytes_on_one_rank() -> None:
    """``optim.per_head=true``: the planned state is what SOAP holds with each attention head's block as its own
    matrix (a smaller L, QL for q/k/v but R, QR of the whole width per head; the reverse for the output projection),
    to the byte, which differs from the whole matrices' figure."""
    from disttrain.optim.soap import build_soap

    model = _gpt()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    config = SoapConfig(precondition_dtype="float64", per_head=True)
    opt = build_soap(config, model)
    opt.step()
    inputs = plan_inputs(_gpt("meta"), SPEC, 1, ParallelConfig(), config, "32-true", PROFILES["h100_sxm"])
    planned = inputs.estimate(Layout()).memory["optimizer"]
    assert planned == _held(opt)
    assert planned != _plan(Layout()).memory["optimizer"]
