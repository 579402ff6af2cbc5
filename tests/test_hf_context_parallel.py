"""Hugging Face Llama-family models (``model=hf``) under context parallelism, through the real runner: parity with
one process (alone, with ZeRO-3, and pipelined, where a stage's layers take their positions from the split), the
unsplit attention left as ``transformers``' own, and the refusal of other architectures.

The parity runs use the family of ``tests/test_parity.py`` that a wrong gradient or norm cannot pass: plain SGD
with clipping that binds on every step. A rank whose rotary angles ignored the split, or whose attention saw only
its own tokens, would move every weight.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from disttrain.config import validate  # noqa: E402
from disttrain.errors import ConfigError  # noqa: E402
from tests.test_hf_models import ARCHS, GPT2, LOSS_RTOL, TINY, WEIGHT_ATOL, hf_overrides  # noqa: E402
from tests.test_parity import FAMILIES, check_against, run_summary  # noqa: E402

SPLIT_ARCHS = {**ARCHS, "mistral": {**TINY, "sliding_window": 32}}
"""The architectures that take a split, Mistral with a window that covers the data's 32-token windows."""
LAYOUTS = {
    "cp2": (["parallel.cp=2"], 2),
    "cp2xzero3": (["parallel=zero3", "parallel.cp=2", "parallel.dp_shard=2"], 4),
    "pp2xcp2": (["parallel=pipeline", "parallel.pp=2", "parallel.cp=2", "parallel.zero_stage=3",
                 "parallel.pipeline.schedule=1f1b"], 4),
}
# measured (fp32, gloo, clipped SGD): losses within 2.2e-7 relative of one process, pre-clip norms 7.3e-7 (Qwen3
# under cp 2 x dp_shard 2), final weights 1.2e-7 absolute, over cp 2 and 4 alone and with ZeRO-3, tp 2 and pp 2
CASES = [("llama", "cp2"), ("llama", "cp2xzero3"), ("llama", "pp2xcp2"), ("qwen3", "cp2")]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One process per model with clipped SGD, computed when first asked for."""
    cache: dict[str, dict] = {}

    def reference(arch: str) -> dict:
        if arch not in cache:
            cache[arch] = run_summary(tmp_path_factory.mktemp(f"{arch}-single"),
                                      [*hf_overrides(arch, SPLIT_ARCHS[arch]), *FAMILIES["sgd+clip"]])
        return cache[arch]

    return reference


@pytest.mark.parametrize(("arch", "layout"), CASES)
def test_a_model_split_over_cp_ranks_matches_one_process(tmp_path, references, arch, layout):
    overrides, ranks = LAYOUTS[layout]
    got = run_summary(tmp_path / "run", [*hf_overrides(arch, SPLIT_ARCHS[arch]), *FAMILIES["sgd+clip"], *overrides,
                                         f"trainer.devices={ranks}"])
    check_against(references(arch), got, clipped=True, loss_rtol=LOSS_RTOL, weight_atol=WEIGHT_ATOL)


@pytest.mark.parametrize("arch", list(SPLIT_ARCHS))
def test_without_a_split_the_attention_is_transformers_sdpa(arch):
    """A model built to take a split computes, while whole, the logits and gradients of the same model on
    ``transformers``' own "sdpa" attention, to the bit."""
    import transformers

    from disttrain.data.spec import DataSpec
    from disttrain.models.hf import HFConfig, build_hf
    from disttrain.models.hf.attention import ATTENTION

    torch.manual_seed(0)
    net = build_hf(HFConfig(arch=arch, fields=SPLIT_ARCHS[arch]), DataSpec("text", vocab_size=256, block_size=32))
    assert net.sequence_split_refusal() is None and net.hf_config._attn_implementation == ATTENTION
    theirs = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(net.hf_config), attn_implementation="sdpa")
    theirs.load_state_dict(net._model.state_dict())
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    ours_logits, their_logits = net(tokens), theirs(input_ids=tokens, use_cache=False).logits
    torch.testing.assert_close(ours_logits, their_logits, rtol=0, atol=0)
    ours_logits.square().mean().backward()
    their_logits.square().mean().backward()
    for (name, ours), theirs_param in zip(net._model.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs_param.grad, rtol=0, atol=0, msg=name)


def test_architectures_without_llamas_attention_are_refused_under_cp(make_config):
    with pytest.raises(ConfigError) as refused:
        validate(make_config([*hf_overrides("gpt2", GPT2), "parallel.cp=2", "trainer.devices=2"]))
    message = str(refused.value)
    assert "\n" not in message
    assert "parallel.cp" in message and "gpt2" in message and "llama, qwen3, mistral" in message, message
    windowed = {**TINY, "sliding_window": 16}
    with pytest.raises(ConfigError, match=r"parallel\.cp.*sliding window of 16 tokens.*llama, qwen3, mistral"):
        validate(make_config([*hf_overrides("mistral", windowed), "parallel.cp=2", "trainer.devices=2"]))
