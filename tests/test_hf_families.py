"""Every Hugging Face family under every layout: a tiny config of each family that LLM teams fine-tune runs under
ZeRO-3, tensor parallelism, a two-stage pipeline and (mixtures) expert parallelism at parity with one process, or
is refused before any rank starts in one line naming what is missing.

Which layout each family takes is a table here (``REFUSED``), so a family that loses a layout fails the cheap
test below, which validates every pair without starting a rank. The parity runs are compared as
``tests/test_parity.py`` compares the built-in GPT (plain SGD with clipping that binds on every step: losses,
pre-clip norms, final weights and the exported validation loss). They are marked slow: each layout of each family
that needs its own code also runs in the default suite, in the file of that code (``test_hf_models.py``,
``test_hf_tensor_parallel.py``, ``test_hf_pipeline.py``, ``test_hf_expert_parallel.py``,
``test_hf_attention_choice.py``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from disttrain.config import validate  # noqa: E402
from disttrain.errors import ConfigError  # noqa: E402
from tests.test_hf_models import LOSS_RTOL, TINY, WEIGHT_ATOL, hf_overrides  # noqa: E402
from tests.test_hf_tensor_parallel import MLA  # noqa: E402
from tests.test_parity import FAMILIES, check_against, run_summary, single_process_runs  # noqa: E402

WINDOW = {"sliding_window": 8}  # shorter than the parity data's sequences: the windowed mask is what is fed
FAMILY_FIELDS = {
    "llama": TINY,
    "mistral": {**TINY, **WINDOW},
    "qwen2": TINY,
    "qwen3": {**TINY, "head_dim": 16},
    "gemma2": {**TINY, "head_dim": 16, **WINDOW},  # eager attention, by default with a notice
    "gemma3_text": {**TINY, "head_dim": 16, **WINDOW},
    "phi3": {**TINY, "pad_token_id": 0},  # its default pad token (32000) is outside the tiny vocabulary
    "olmo2": TINY,
    "gpt_neox": {key: value for key, value in TINY.items() if key != "num_key_value_heads"},
    "mixtral": {**TINY, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {**TINY, "moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2},
    "deepseek_v3": MLA,
    "gpt_oss": {**TINY, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, **WINDOW},
}
MIXTURES = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
LAYOUTS = {
    "zero3": ["parallel=zero3", "trainer.devices=2"],
    "tp": ["parallel=tp", "trainer.devices=2"],
    "pp": ["parallel=pipeline", "parallel.pipeline.schedule=1f1b", "trainer.devices=2"],
    "ep": ["parallel=zero3", "parallel.ep=2", "trainer.devices=2"],
}
REFUSED: dict[tuple[str, str], str] = {
    **{(family, "ep"): "expert_parallel" for family in FAMILY_FIELDS if family not in MIXTURES},
    # Gemma ties its head to its embedding by default, and two stages cannot hold one parameter
    **{(family, "pp"): "+model.tie_word_embeddings=false" for family in ("gemma2", "gemma3_text")},
}
"""``(family, layout)`` -> what its one-line refusal names: expert parallelism where there are no experts, and
the field that unties a head from its embedding for a pipeline."""
PAIRS = [(family, layout) for family in FAMILY_FIELDS for layout in LAYOUTS]
# measured over the matrix (fp32, gloo): losses within 2.7e-7 relative of one process, final weights 1.2e-7
# absolute, pre-clip norms 6.2e-7 but for Phi-3, whose norm adds its gathered (tp) or micro-batched (pp) parts in
# another order: 2.2e-6. A gradient off by a factor or not summed over ranks moves them by 1e-3 or more.
NORM_RTOL = 4e-6


def overrides(family: str, layout: str | None = None) -> list[str]:
    """The parity suite's run of ``family`` (clipped plain SGD), under ``layout`` (None: one process)."""
    return [*hf_overrides(family, FAMILY_FIELDS[family]), *FAMILIES["sgd+clip"], *LAYOUTS.get(layout, [])]


@pytest.mark.parametrize(("family", "layout"), PAIRS)
def test_each_family_takes_each_layout_or_is_refused_in_one_line(family, layout, make_config):
    """Validation (no rank started) accepts the pair, or refuses it in one line naming the missing piece."""
    cfg = make_config(overrides(family, layout))
    if (family, layout) not in REFUSED:
        validate(cfg)
        return
    with pytest.raises(ConfigError) as refused:
        validate(cfg)
    message = str(refused.value)
    assert "\n" not in message and REFUSED[family, layout] in message, message


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One process per family, computed when first asked for."""
    return single_process_runs(tmp_path_factory, overrides)


@pytest.mark.slow
@pytest.mark.parametrize(("family", "layout"), [pair for pair in PAIRS if pair not in REFUSED])
def test_each_family_matches_one_process_under_each_layout(family, layout, references, tmp_path):
    got = run_summary(tmp_path / "run", overrides(family, layout))
    check_against(references(family), got, clipped=True, loss_rtol=LOSS_RTOL, weight_atol=WEIGHT_ATOL,
                  norm_rtol=NORM_RTOL)
