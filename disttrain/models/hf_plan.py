"""The parallel plan of a Hugging Face model, read from what its config declares.

``base_model_tp_plan`` maps module patterns of the base model to ``transformers``' tensor-parallel styles; the
ones disttrain honours are translated (``colwise``, ``rowwise``, and ``replicated_with_grad_allreduce`` as
``per_head``), any other is refused by name. ``base_model_pp_plan`` lists the base model's modules whose
application in turn, followed by the head, is the forward; the decoder layers then need their rotary positions,
which a hook supplies when a pipeline stage calls a layer on its own (the model's forward passes them itself).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from disttrain.errors import ConfigError
from disttrain.models.attention import positions_of

TP_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "replicated_with_grad_allreduce": "per_head"}
"""``transformers``' tensor-parallel styles that disttrain honours, and their names here."""
PIPELINE_TYPES = ("llama", "qwen3")
"""Model types whose base-model units applied in turn equal the model's forward (causal attention with no
mask, positions counted from 0 and no sliding window): checked against ``transformers`` in the tests."""


def _base(net: nn.Module) -> tuple[str, Any]:
    """The base model's attribute name (``model``, ``transformer``) and the base model."""
    prefix = net._model.base_model_prefix
    return prefix, getattr(net, prefix)


def tp_plan(net: nn.Module) -> dict[str, str]:
    """The config's tensor-parallel plan under the network's names and disttrain's styles."""
    prefix, _ = _base(net)
    plan = getattr(net.hf_config, "base_model_tp_plan", None) or {}
    ours = {}
    for pattern, style in plan.items():
        if style not in TP_STYLES:
            raise ConfigError("parallel.tp", f"{pattern}: {style}", f"1 for model type {net.hf_config.model_type}: "
                              f"its tp plan uses style {style!r}, and disttrain runs {sorted(TP_STYLES)}")
        ours[f"{prefix}.{pattern}"] = TP_STYLES[style]
    return ours


def pipeline_units(net: nn.Module) -> list[str]:
    """The config's pipeline units under the network's names, and the head."""
    prefix, _ = _base(net)
    plan = getattr(net.hf_config, "base_model_pp_plan", None)
    model_type = net.hf_config.model_type
    if not plan or model_type not in PIPELINE_TYPES:
        raise ConfigError("parallel.pp", model_type, f"1 for this model: disttrain cuts pipeline stages of the model "
                          f"types {list(PIPELINE_TYPES)} (their declared units, applied in turn, are the forward)")
    return [f"{prefix}.{name}" for name in plan] + ["lm_head"]


def layer_lists(net: nn.Module) -> list[str]:
    """The ``ModuleList`` names that hold the model's decoder layers (its never-split classes)."""
    never_split = set(getattr(net._model, "_no_split_modules", None) or ())
    return [name for name, module in net.named_modules()
            if isinstance(module, nn.ModuleList) and len(module) and type(module[0]).__name__ in never_split]


def prepare_layers(net: nn.Module) -> None:
    """Let a decoder layer of a pipelined model type run on its own: a hook gives it the rotary positions of its
    input (where its split places them, under context parallelism) when its caller (a pipeline stage) passes
    none."""
    if net.hf_config.model_type not in PIPELINE_TYPES:
        return
    _, base = _base(net)
    rotary = base.rotary_emb
    for layer in base.layers:
        layer.register_forward_pre_hook(_positions_hook(rotary), with_kwargs=True)


def _positions_hook(rotary: nn.Module) -> Any:
    def give_positions(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if kwargs.get("position_embeddings") is not None:
            return None  # the model's own forward passed them
        hidden = args[0] if args else kwargs["hidden_states"]
        if rotary.inv_freq.device != hidden.device:  # a stage holds no rotary module of its own to move
            rotary.to(hidden.device)
        # under context parallelism the layer holds a slice of the sequence, at the positions its split says
        split = getattr(module.self_attn, "sequence_split", None)
        positions = positions_of(hidden.shape[1], hidden.device, split).unsqueeze(0)
        return args, {**kwargs, "position_ids": positions, "position_embeddings": rotary(hidden, positions)}

    return give_positions
