"""Hugging Face mixtures of experts (Mixtral, Qwen3-MoE) under expert parallelism: their grouped experts split over
the ep ranks (``disttrain.models.hf_experts``) train as one process holding every expert does: loss curve, pre-clip
gradient norms (clipping binds on every step), final weights.

Plain SGD without momentum, so a wrong gradient anywhere (an expert's rows sent to the wrong rank, a gradient scaled
twice or not summed over the ranks whose tokens an expert computed) moves the weights by it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from disttrain.config import validate  # noqa: E402
from disttrain.errors import ConfigError  # noqa: E402
from tests.test_hf_models import LOSS_RTOL, WEIGHT_ATOL  # noqa: E402
from tests.test_moe_config import hf_moe_overrides  # noqa: E402
from tests.test_parity import FAMILIES, check_against, run_summary  # noqa: E402

LAYOUTS = {
    "ep2": (["parallel=zero3", "parallel.ep=2"], 2),
    "ep2xdp_shard2": (["parallel=zero3", "parallel.ep=2"], 4),
}
NORM_RTOL = 2e-6


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One process per architecture, run when first asked for."""
    runs: dict[str, dict] = {}

    def reference(arch: str) -> dict:
        if arch not in runs:
            runs[arch] = run_summary(tmp_path_factory.mktemp(arch), [*hf_moe_overrides(arch), *FAMILIES["sgd+clip"]])
        return runs[arch]

    return reference


@pytest.mark.parametrize(("arch", "layout"), [("mixtral", "ep2"), ("qwen3_moe", "ep2")])
def test_hf_mixture_under_expert_parallelism_matches_one_process(tmp_path, references, arch, layout):
    overrides, ranks = LAYOUTS[layout]
    got = run_summary(tmp_path / "run", [*hf_moe_overrides(arch), *FAMILIES["sgd+clip"], *overrides,
                                         f"trainer.devices={ranks}"])
    check_against(references(arch), got, clipped=True, loss_rtol=LOSS_RTOL, weight_atol=WEIGHT_ATOL,
                  norm_rtol=NORM_RTOL)


def test_hf_models_without_grouped_experts_are_refused_in_one_line(make_config):
    """A dense model (its config declares no ``base_model_ep_plan``) and an ep that does not divide the experts."""
    from tests.test_hf_models import ARCHS, hf_overrides

    degrees = ["parallel=zero3", "parallel.ep=2", "trainer.devices=2"]
    with pytest.raises(ConfigError, match=r"^parallel\.ep=2 is invalid: 1 for model hf \(llama\): expert parallelism "
                                          r"splits grouped experts.*base_model_ep_plan names, and llama names none"
                       ) as raised:
        validate(make_config([*hf_overrides("llama", ARCHS["llama"]), *degrees]))
    assert "\n" not in str(raised.value)
    with pytest.raises(ConfigError, match=r"^parallel\.ep=3 is invalid: a divisor of model\.n_experts=4"):
        validate(make_config([*hf_moe_overrides("mixtral"), "parallel=zero3", "parallel.ep=3", "trainer.devices=3",
                              "batch.global_size=9"]))
