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

from disttrain.launch.job import train
from tests.conftest import compose_config, logged_metric
from tests.test_parity import BASE, CLIP, check_against, relative_deviation, run_summary
from tests.test_resume_layouts import BASE as RESUME_BASE
from tests.test_resume_layouts import SAVED
from tests.test_resume_layouts import STEPS as RESUME_STEPS
from tests.test_run import step_losses

MOE_MODEL = ["model=moe", "model.flavour=micro", "model.n_experts=4", "model.top_k=2", "model.aux_loss_coef=0.1",
             "model.bias_update_rate=0.01"]
MOE = [*(o for o in BASE if not o.startswith("model")), *MOE_MODEL, f"trainer.gradient_clip_val={CLIP}"]
LAYOUTS = {
    "ep2": (["parallel=zero3", "parallel.ep=2"], 2),
    "ep4": (["parallel=zero3", "parallel.ep=4"], 4),
    "ep2xdp_shard2": (["parallel=zero3", "parallel.ep=2"], 4),
    "ep2xpp2": (["parallel=pipeline", "parallel.pp=2", "parallel.dp_shard=2", "parallel.zero_stage=3",
                 "parallel.ep=2"], 4),
    "ep2xcp2": (["parallel=zero3", "parallel.dp_shard=2", "parallel.cp=2", "parallel.ep=2"], 4),
    "ep2xtp2": (["parallel=hybrid", "parallel.tp=2", "parallel.ep=2"], 4),
    "ep2+hsdp": (["parallel=hsdp", "parallel.ep=2"], 4),
    "ep2+full": (["parallel=zero3", "parallel.ep=2", "parallel.activation_checkpoint=full"], 2),
    "ep2xpp2+full": (["parallel=pipeline", "parallel.pp=2", "parallel.dp_shard=2", "parallel.zero_stage=3",
                      "parallel.ep=2", "parallel.activation_checkpoint=full"], 4),
}
STATISTICS = ("moe/load_max_over_mean", "moe/balance_loss", "moe/tokens_expert_0", "moe/tokens_expert_3")
# measured over the layouts (fp32, gloo): pre-clip norms within 1.06e-6 relative (ep2xdp_shard2, whose expert
# gradients add up in a different order; the others below 1e-6), router statistics within 1e-7 (exact counts)
NORM_RTOL, STATISTICS_RTOL = 2e-6, 1e-6
# measured (fp32, gloo): resumed steps within 9.7e-8 relative of the saving run's
RESUME_RTOL = 1e-6


def moe_summary(run_dir, overrides: list[str]) -> dict:
    """``run_summary`` of a mixture run plus its logged router statistics and results."""
    summary = run_summary(run_dir, overrides)
    summary["statistics"] = {key: [value for _, value in logged_metric(run_dir, key)] for key in STATISTICS}
    summary["experts"] = json.loads((run_dir / "results.json").read_text())["experts"]
    return summary


CAPACITY = ["model.capacity_factor=1.0"]
"""Experts that drop what exceeds their capacity (33% of the assignments over the reference run)."""


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One process's run of each family (no drops, drops), run when first asked for."""
    runs: dict[str, dict] = {}

    def reference(family: str) -> dict:
        if family not in runs:
            extra = CAPACITY if family == "capacity" else []
            runs[family] = moe_summary(tmp_path_factory.mktemp(family), [*MOE, *extra])
        return runs[family]

    return reference


@pytest.mark.parametrize(("layout", "family"), [*((name, "all") for name in LAYOUTS), ("ep2xdp_shard2", "capacity"),
                                                ("ep2xpp2", "capacity")])
def test_expert_parallel_matches_one_process(tmp_path, references, layout, family):
    overrides, ranks = LAYOUTS[layout]
    reference = references(family)
    extra = CAPACITY if family == "capacity" else []
    got = moe_summary(tmp_path / "run", [*MOE, *extra, *overrides, f"trainer.devices={ranks}"])
    if family == "capacity":  # the same assignments dropped as in one process, and there were some
        assert got["experts"]["dropped_fraction"] == reference["experts"]["dropped_fraction"] > 0.05
    check_against(reference, got, clipped=True, norm_rtol=NORM_RTOL)
    for key, values in reference["statistics"].items():
        assert relative_deviation(values, got["statistics"][key]) <= STATISTICS_RTOL, key
    assert got["experts"]["tokens_per_expert"] == reference["experts"]["tokens_per_expert"]
    torch.testing.assert_close(got["weights"]["layers.0.feed_forward.expert_bias"],
                               reference["weights"]["layers.0.feed_forward.expert_bias"], rtol=0, atol=0)


RESUME = [*(o for o in RESUME_BASE if not o.startswith("model")), *MOE_MODEL]
RESUME_LAYOUTS = {"single": ([], 1), "ep2": (LAYOUTS["ep2"][0], 2), "ep4": (LAYOUTS["ep4"][0], 4),
                  "ep2xpp2": LAYOUTS["ep2xpp2"]}


@pytest.mark.parametrize(("before", "after"), [("ep2", "ep4"), ("ep4", "single"), ("single", "ep2xpp2")])
def test_an_expert_parallel_checkpoint_resumes_under_another_ep(tmp_path, before, after):
    """AdamW's moments, the routing biases and the experts' shards move between ep degrees (and to one process,
    and into pipeline stages): the resumed steps continue the saving run's curve."""
    curves = {}
    for name, resume in ((before, None), (after, f"last-step{SAVED}.ckpt")):
        overrides, ranks = RESUME_LAYOUTS[name]
        extra = [f"resume={tmp_path / before / 'checkpoints' / resume}"] if resume else []
        train(compose_config([*RESUME, *overrides, f"trainer.devices={ranks}", *extra], tmp_path / name))
        curves[name] = step_losses(tmp_path / name)
    resumed = curves[after][-(RESUME_STEPS - SAVED):]
    assert len(resumed) == RESUME_STEPS - SAVED
    assert relative_deviation(curves[before][SAVED:], resumed) <= RESUME_RTOL, (curves[before][SAVED:], resumed)


@pytest.mark.parametrize(("overrides", "message"), [
    (["parallel=ddp", "parallel.ep=2", "trainer.devices=2"], r"^parallel\.ep=2 is invalid: a divisor of parallel\."),
    (["parallel=zero1", "parallel.ep=2", "trainer.devices=2"], r"^parallel\.zero_stage=1 is invalid: 2 or 3 with "),
    (["parallel=zero3", "parallel.ep=4", "trainer.devices=2"], r"^parallel\.ep=4 is invalid: a divisor of "),
    (["parallel=zero3", "parallel.ep=3", "trainer.devices=3", "batch.global_size=9"],
     r"^parallel\.ep=3 is invalid: a divisor of model\.n_experts=4"),
    (["parallel=zero3", "parallel.ep=0", "trainer.devices=2"], r"^parallel\.ep=0 is invalid: a positive degree"),
    (["parallel=zero3", "parallel.ep=2", "trainer.devices=2", "parallel.activation_checkpoint=selective"],
     r"^parallel\.activation_checkpoint='selective' is invalid: none or full with parallel\.ep=2"),
    (["parallel=hybrid", "parallel.tp=2", "parallel.ep=2", "parallel.sequence_parallel=true", "trainer.devices=4"],
     r"^parallel\.sequence_parallel=true is invalid: false with parallel\.ep=2"),
    (["parallel=zero3", "parallel.dp_shard=2", "parallel.cp=2", "parallel.ep=2", "trainer.devices=4",
      "model.capacity_factor=1.0"], r"^model\.capacity_factor=1\.0 is invalid: null with parallel\.cp=2"),
])
def test_expert_parallel_refusals_name_the_key_before_ranks_start(make_config, overrides, message):
    from disttrain.config.validation import validate
    from disttrain.errors import ConfigError

    with pytest.raises(ConfigError, match=message) as raised:
        validate(make_config([*MOE, *overrides]))
    assert "\n" not in str(raised.value)


def test_a_dense_model_is_refused_expert_parallelism(make_config):
    from disttrain.config.validation import validate
    from disttrain.errors import ConfigError

    dense = [o for o in MOE if not o.startswith("model.") or o.startswith("model.flavour")]
    dense = ["model=llama" if o == "model=moe" else o for o in dense]
    with pytest.raises(ConfigError, match=r"^parallel\.ep=2 is invalid: 1 for model llama: expert parallelism "
                                          r"splits grouped experts") as raised:
        validate(make_config([*dense, "parallel=zero3", "parallel.ep=2", "trainer.devices=2"]))
    assert "\n" not in str(raised.value)
