"""Expert parallelism equals one process holding every expert: loss curve, pre-clip gradient norms (clipping binds on
every step), final weights, and the router statistics each step logs.

The model routes with both balancing methods on (a balance loss whose gradient a wrong scale would change, and a
routing bias moved by every step's global load, which a wrong count would move differently), and SGD without
momentum, so a wrong gradient anywhere moves the weights by it.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import logged_metric
from tests.test_parity import BASE, CLIP, check_against, relative_deviation, run_summary

MOE = [*(o for o in BASE if not o.startswith("model")), "model=moe", "model.flavour=micro", "model.n_experts=4",
       "model.top_k=2",
       "model.aux_loss_coef=0.1", "model.bias_update_rate=0.01", f"trainer.gradient_clip_val={CLIP}"]
LAYOUTS = {
    "ep2": (["parallel=zero3", "parallel.ep=2"], 2),
    "ep4": (["parallel=zero3", "parallel.ep=4"], 4),
    "ep2xdp_shard2": (["parallel=zero3", "parallel.ep=2"], 4),
    "ep2xpp2": (["parallel=pipeline", "parallel.pp=2", "parallel.dp_shard=2", "parallel.zero_stage=3",
                 "parallel.ep=2"], 4),
    "ep2xcp2": (["parallel=zero3", "parallel.dp_shard=2", "parallel.cp=2", "parallel.ep=2"], 4),
    "ep2xtp2": (["parallel=hybrid", "parallel.tp=2", "parallel.ep=2"], 4),
    "ep2+hsdp": (["parallel=hsdp", "parallel.ep=2"], 4),
}
STATISTICS = ("moe/load_max_over_mean", "moe/balance_loss", "moe/tokens_expert_0", "moe/tokens_expert_3")
# measured over the layouts (fp32, gloo): pre-clip norms within 1.06e-6 relative (ep2xdp_shard2, whose expert
# gradients add up in a different order; the others below 1e-6), router statistics within 1e-7 (exact counts)
NORM_RTOL, STATISTICS_RTOL = 2e-6, 1e-6


def moe_summary(run_dir, overrides: list[str]) -> dict:
    """``run_summary`` of a mixture run plus its logged router statistics and results."""
    summary = run_summary(run_dir, overrides)
    summary["statistics"] = {key: [value for _, value in logged_metric(run_dir, key)] for key in STATISTICS}
    summary["experts"] = json.loads((run_dir / "results.json").read_text())["experts"]
    return summary


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    return moe_summary(tmp_path_factory.mktemp("single"), MOE)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_matches_one_process(tmp_path, reference, layout):
    overrides, ranks = LAYOUTS[layout]
    got = moe_summary(tmp_path / "run", [*MOE, *overrides, f"trainer.devices={ranks}"])
    check_against(reference, got, clipped=True, norm_rtol=NORM_RTOL)
    for key, values in reference["statistics"].items():
        assert relative_deviation(values, got["statistics"][key]) <= STATISTICS_RTOL, key
    assert got["experts"]["tokens_per_expert"] == reference["experts"]["tokens_per_expert"]
    torch.testing.assert_close(got["weights"]["layers.0.feed_forward.expert_bias"],
                               reference["weights"]["layers.0.feed_forward.expert_bias"], rtol=0, atol=0)
