"""The planner's pass on ``transformers`` models: attention counted as the fused kernels hold it
(``disttrain.plan.ops.FusedAttention``), so a ``transformers`` Llama and the built-in Llama of the same network
plan alike, and activations match what a CPU run of the model holds.

``transformers``' SDPA attention hands grouped-query attention to the kernel whole (``enable_gqa``), where the
built-in model repeats the key and value heads first; both must reach the fused kernel on the meta device, whose
reference path would keep a tokens x tokens matrix per head. Its mask builder asks of the positions whether a
mask is needed (``disttrain.plan.data_checks``), and a sliding window's boolean mask reaches the kernel as the
additive mask torch makes of it.
"""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("transformers")

from disttrain.config.typed import model_typed  # noqa: E402
from disttrain.data.spec import DataSpec, example_batch  # noqa: E402
from disttrain.models import MODELS, build_model  # noqa: E402
from disttrain.parallel.config import ParallelConfig  # noqa: E402
from disttrain.plan.hardware import PROFILES  # noqa: E402
from disttrain.plan.inputs import PlanInputs  # noqa: E402
from disttrain.plan.layout import Layout  # noqa: E402
from disttrain.plan.measure import measured_activations  # noqa: E402
from disttrain.plan.planner import plan_inputs  # noqa: E402


def _plans(seq: int, vocab: int, layers: int, heads: int, kv_heads: int, hidden: int, mlp: int,
           micro: int) -> tuple[PlanInputs, PlanInputs]:
    """Plan inputs of the built-in Llama and of ``transformers``' Llama of these sizes, both built on the meta
    device, for a bf16-mixed run on H100s."""
    spec = DataSpec("text", vocab_size=vocab, block_size=seq)
    built_in = {"name": "llama", "n_layer": layers, "n_head": heads, "n_kv_head": kv_heads, "n_embd": hidden,
                "mlp_hidden": mlp, "rope_theta": 500000.0, "block_size": seq, "vocab_size": vocab}
    hf = {"name": "hf", "arch": "llama", "hidden_size": hidden, "intermediate_size": mlp, "num_hidden_layers": layers,
          "num_attention_heads": heads, "num_key_value_heads": kv_heads, "max_position_embeddings": seq,
          "vocab_size": vocab, "tie_word_embeddings": False}
    plans = []
    for cfg in (built_in, hf):
        with torch.device("meta"):
            net = build_model(model_typed(OmegaConf.create(cfg), MODELS), spec)
        plans.append(plan_inputs(net, spec, micro, ParallelConfig(), OmegaConf.create({"name": "adamw"}),
                                 "bf16-mixed", PROFILES["h100_sxm"]))
    return plans[0], plans[1]


def test_grouped_query_attention_from_transformers_keeps_what_the_fused_kernel_keeps() -> None:
    """Sequences long against the width, where one tokens x tokens matrix per head would outweigh the rest."""
    seq, micro, heads = 2048, 2, 4
    built_in, hf = _plans(seq, 512, layers=2, heads=heads, kv_heads=2, hidden=256, mlp=688, micro=micro)
    one_head_scores = micro * seq * seq * 2  # bf16
    for inputs in (built_in, hf):
        assert max(inputs.stats.largest_saved.values()) < one_head_scores
    # the kernel keeps its output and log-sum-exp (and its inputs, made by the projections): the same in both
    attention = [[kinds["attention"] for unit, kinds in inputs.stats.saved_by_kind.items()
                  if unit in inputs.stats.shard_units] for inputs in (built_in, hf)]
    assert attention[0] == attention[1] and all(attention[0])
    assert hf.stats.total_flops == built_in.stats.total_flops


def test_the_8b_llama_plans_alike_built_in_and_from_transformers() -> None:
    """Llama 3 8B on 8 H100s, bf16, selective checkpointing, 2 x 8192 tokens per rank: the same memory and,
    within what the two implementations run differently, the same step time."""
    built_in, hf = _plans(8192, 128256, layers=32, heads=32, kv_heads=8, hidden=4096, mlp=14336, micro=2)
    layout = Layout(dp_shard=8, zero_stage=3, activation_checkpoint="selective", micro_size=2)
    ours, theirs = built_in.estimate(layout), hf.estimate(layout)
    # measured here: 94.40 GB both (665 GB for transformers' model while its attention took the reference path)
    assert theirs.total_bytes == pytest.approx(ours.total_bytes, rel=0.02)
    assert hf.stats.total_flops == built_in.stats.total_flops
    # measured here: 2.83 s and 2.91 s. The built-in model runs kernels transformers' does not: it repeats the key
    # and value heads before attention (transformers' SDPA passes enable_gqa instead; 0.8% of the step) and rotates
    # interleaved pairs with selects and a stack (transformers rotates halves; 2.0%)
    assert theirs.step_s == pytest.approx(ours.step_s, rel=0.04)


TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 256}
ARCHS = {
    "llama": {},  # grouped-query attention through enable_gqa, no mask
    "qwen2": {},  # transformers' mask builder, which asks of the positions whether a mask is needed (it is not)
    "mistral": {"sliding_window": 64},  # a window shorter than the sequence: a mask per layer
}


@pytest.mark.parametrize("arch", list(ARCHS))
def test_activations_of_transformers_attention_are_what_a_cpu_run_holds(arch: str) -> None:
    """Against what a real forward and backward of the model holds on this CPU (``measured_activations``), whose
    SDPA runs the fused kernel as a GPU's does: grouped keys and values whole, a boolean mask made additive."""
    torch.manual_seed(0)
    spec, micro = DataSpec("text", vocab_size=96, block_size=256), 2
    net = build_model(model_typed(OmegaConf.create({"name": "hf", "arch": arch, **TINY, **ARCHS[arch]}), MODELS), spec)
    inputs = plan_inputs(net, spec, micro, ParallelConfig(), OmegaConf.create({"name": "adamw"}), "32-true",
                         PROFILES["h100_sxm"])
    predicted = inputs.estimate(Layout(micro_size=micro)).memory["activations"]
    measured = measured_activations(net, example_batch(spec, micro))[1]
    # measured here: 1.000 of the measured peak for each. Llama: 2.01 while the pass took the reference path for
    # enable_gqa; Mistral: 0.86 while its boolean mask went to the kernel as it was; Qwen2 and Mistral stopped
    # at their mask builder's question of the positions, and before that at their refusal of pipeline stages
    assert predicted == pytest.approx(measured, rel=0.05), (predicted, measured)
