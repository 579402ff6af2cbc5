"""Pipeline stages of Hugging Face models: for every model type disttrain cuts, the declared units applied in turn
(what the stages run, each decoder layer fed by ``disttrain.models.hf.pipeline``) are ``transformers``' own
forward, on tiny configs with sliding windows shorter than the sequence and per-layer attention types where the
family has them; a 2-stage pipeline trains as one process; the types that are not cut are refused in one line.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from disttrain.data.spec import DataSpec  # noqa: E402
from disttrain.models.hf import HFCausalLM, HFConfig, build_hf  # noqa: E402
from disttrain.models.hf import pipeline as hf_pipeline  # noqa: E402
from disttrain.parallel.model_plan import pipeline_units_of  # noqa: E402

VOCAB, LENGTH, WINDOW = 256, 32, 8
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 64}
HEADS16 = {**TINY, "head_dim": 16}
SLIDING = {"sliding_window": WINDOW}
# the first layer slides over WINDOW tokens, the second sees every earlier one
MIXED = {**SLIDING, "layer_types": ["sliding_attention", "full_attention"]}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
FAMILIES = {
    "llama": TINY,
    "mistral": {**TINY, **SLIDING},
    "qwen2": {**TINY, **MIXED, "use_sliding_window": True},
    "qwen3": {**HEADS16, **MIXED, "use_sliding_window": True},
    "gemma": HEADS16,
    "gemma2": {**HEADS16, **MIXED},
    "gemma3_text": {**HEADS16, **MIXED, "final_logit_softcapping": 30.0},
    "phi3": {**TINY, **SLIDING, "pad_token_id": 0},
    "olmo2": TINY,
    "gpt_neox": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "max_position_embeddings": 64, "hidden_dropout": 0.0, "attention_dropout": 0.0},
    "mixtral": {**TINY, **SLIDING, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {**TINY, **MOE, **MIXED, "use_sliding_window": True, "shared_expert_intermediate_size": 32},
    "qwen3_moe": {**TINY, **MOE},
    "deepseek_v3": {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4,
                    "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
                    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
                    "v_head_dim": 16, "max_position_embeddings": 64},
    "gpt_oss": {**HEADS16, **MIXED, "num_local_experts": 4, "num_experts_per_tok": 2},
}
EAGER = ("gemma2",)
"""Types transformers builds with eager attention only (Gemma 2 soft-caps its attention scores, which SDPA
cannot)."""


def tiny(model_type: str) -> HFCausalLM:
    """A seeded tiny ``model_type`` model as ``model=hf`` builds it (SDPA), or with eager attention for ``EAGER``."""
    torch.manual_seed(0)
    spec = DataSpec("text", vocab_size=VOCAB, block_size=LENGTH)
    cfg = HFConfig(arch=model_type, fields=FAMILIES[model_type])
    if model_type not in EAGER:
        return build_hf(cfg, spec)
    import transformers

    config = cfg.validate(spec)
    config.use_cache = False
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    return HFCausalLM(model, None, LENGTH)


def test_every_cut_type_is_checked():
    assert set(FAMILIES) == set(hf_pipeline.PIPELINE_TYPES)


def record_layer_inputs(net: HFCausalLM) -> list[dict]:
    """What each decoder layer of ``net`` is called with, appended on every call (after the stage's feeding)."""
    calls: list[dict] = []
    for layer in net.get_submodule(net._model.base_model_prefix).layers:
        layer.register_forward_pre_hook(lambda module, args, kwargs: calls.append(
            {key: kwargs.get(key) for key in ("position_ids", "position_embeddings", "attention_mask")}),
            with_kwargs=True)
    return calls


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_units_in_turn_are_the_models_forward(model_type):
    """The stages' units in turn give the forward's logits exactly, each decoder layer called with the positions,
    rotary embeddings and mask the forward gives it."""
    net = tiny(model_type).eval()
    assert net.pipeline_refusal() is None
    calls = record_layer_inputs(net)
    tokens = torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = net(tokens)
        x = tokens
        for name in pipeline_units_of(net):
            x = net.get_submodule(name)(x)
    torch.testing.assert_close(x, whole, rtol=0, atol=0)
    layers = len(calls) // 2
    assert layers == FAMILIES[model_type]["num_hidden_layers"]
    for forward, stage in zip(calls[:layers], calls[layers:], strict=True):
        torch.testing.assert_close(stage, forward, rtol=0, atol=0)


def test_the_layers_of_a_stage_share_one_mask():
    """Layers of one type get the same mask object, as the forward's do: one mask is held for backward, not one
    per layer."""
    net = tiny("mistral")
    calls = record_layer_inputs(net)
    x = torch.randint(0, VOCAB, (2, LENGTH))
    for name in pipeline_units_of(net):
        x = net.get_submodule(name)(x)
    first, second = calls
    assert first["attention_mask"] is not None and first["attention_mask"] is second["attention_mask"]


@pytest.mark.parametrize("model_type", ["mistral", "gemma3_text"])
def test_the_masks_a_stage_builds_follow_the_attention_implementation(model_type):
    """Switched to eager attention (which takes a float mask even where SDPA's is causal without one), the units in
    turn are still the forward: a stage's masks are built for the implementation the model runs."""
    net = tiny(model_type).eval()
    net._model.set_attn_implementation("eager")
    tokens = torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        x = tokens
        for name in pipeline_units_of(net):
            x = net.get_submodule(name)(x)
        torch.testing.assert_close(x, net(tokens), rtol=0, atol=0)


REFUSED = {
    "gpt2": ({"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64}, "model type gpt2 declares no "
             "base_model_pp_plan"),
    # Granite scales its embeddings and logits in the model's forward, outside the units it declares
    "granite": (TINY, "model type granite's declared units, applied in turn, are not checked against its forward"),
    "gemma3_text": ({**HEADS16, "use_bidirectional_attention": True},
                    "model type gemma3_text with use_bidirectional_attention=true: a stage feeds its layers causal"),
}


@pytest.mark.parametrize("model_type", list(REFUSED))
def test_a_type_that_is_not_cut_is_refused_in_one_line_naming_it(make_config, model_type):
    """The refusal names the degree as the value and the model type as the reason; the model still plans and trains
    without a pipeline (no units rather than an error)."""
    from disttrain.config import validate
    from disttrain.errors import ConfigError
    from tests.test_hf_models import hf_overrides

    fields, reason = REFUSED[model_type]
    with pytest.raises(ConfigError) as refused:
        validate(make_config([*hf_overrides(model_type, fields), "parallel=pipeline", "trainer.devices=2"]))
    message = str(refused.value)
    assert message.startswith("parallel.pp=2 is invalid: 1 for model hf: ") and reason in message, message
    assert "\n" not in message
    net = build_hf(HFConfig(arch=model_type, fields=fields), DataSpec("text", vocab_size=VOCAB, block_size=LENGTH))
    assert pipeline_units_of(net) is None


# a sliding window shorter than the sequence; local and global layers with their own rotary and a soft-capped head;
# routed experts. Untied heads: a stage cannot share the embedding with the last one.
RUN_TYPES = ("mistral", "gemma3_text", "mixtral")


@pytest.mark.parametrize("model_type", RUN_TYPES)
def test_a_two_stage_pipeline_trains_as_one_process(tmp_path, model_type):
    """Two stages (1F1B, gloo) against one process: losses, validation loss and final weights, as the parity
    suite compares them."""
    from tests.test_hf_models import LAYOUTS, LOSS_RTOL, WEIGHT_ATOL, hf_overrides
    from tests.test_parity import FAMILIES as STEP_FAMILIES
    from tests.test_parity import check_against, run_summary

    model = [*hf_overrides(model_type, {**FAMILIES[model_type], "tie_word_embeddings": False}),
             *STEP_FAMILIES["sgd"]]
    reference = run_summary(tmp_path / "single", model)
    overrides, ranks = LAYOUTS["pp"]
    got = run_summary(tmp_path / "pp", [*model, *overrides, f"trainer.devices={ranks}"])
    check_against(reference, got, clipped=False, loss_rtol=LOSS_RTOL, weight_atol=WEIGHT_ATOL)


def test_a_stage_trains_after_validating_under_inference_mode():
    """What a stage's layers are fed is rebuilt outside inference mode: tensors made inside it (Lightning
    validates under it) cannot be saved for a later training step's backward."""
    net = tiny("mistral")
    tokens = torch.randint(0, VOCAB, (2, LENGTH), generator=torch.Generator().manual_seed(1))

    def units_in_turn() -> torch.Tensor:
        x = tokens
        for name in pipeline_units_of(net):
            x = net.get_submodule(name)(x)
        return x

    with torch.inference_mode():
        validated = units_in_turn()
    logits = units_in_turn()
    logits.sum().backward()
    torch.testing.assert_close(logits.detach(), validated, rtol=0, atol=0)
    assert all(p.grad is not None for p in net.parameters())


IGNORED_FIELDS = {"mistral": ("layer_types", {**FAMILIES["mistral"],
                                               "layer_types": ["full_attention", "sliding_attention"]}),
                  "llama": ("sliding_window", {**TINY, "sliding_window": WINDOW})}


@pytest.mark.parametrize("model_type", list(IGNORED_FIELDS))
def test_mask_fields_a_forward_does_not_read_are_refused(model_type):
    """A config file may carry mask fields its model type's forward ignores (layer_types in a Mistral config, as
    some converted checkpoints have; a sliding window in a Llama one): transformers' mask builder would follow them
    where the forward does not (the units in turn then differ from it), so they are refused, naming the field."""
    import transformers

    field, fields = IGNORED_FIELDS[model_type]
    config = transformers.AutoConfig.for_model(model_type, vocab_size=VOCAB, **fields)
    net = HFCausalLM(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"), None, LENGTH)
    assert f"model type {model_type} with {field} in its config" in net.pipeline_refusal()
    assert pipeline_units_of(net) is None
