"""The parallel plan of a Hugging Face model, read from what its config declares.

``base_model_tp_plan`` maps module (and parameter) patterns of the base model to ``transformers``' tensor-parallel
styles, translated into disttrain's (``TP_STYLES``); a grouped-experts module (``moe_tp_experts``) is split into
whole experts, which covers its parameters' own entries (``packed_colwise``, ...). A style disttrain cannot run
exactly is refused in one line that says why and names the plan without it (``parallel.tp_plan``). The pipeline
stages cut from ``base_model_pp_plan`` are ``disttrain.models.hf.pipeline``'s.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

from torch import nn

from disttrain.errors import ConfigError
from disttrain.models.heads import COLUMNS, ROWS, HeadBlocks

TP_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "replicated_with_grad_allreduce": "per_head",
             "colwise_gather_output": "colwise_gather", "colwise_rep": "colwise_gather",
             "rowwise_split_input": "rowwise_whole_input", "rowwise_rep": "rowwise_whole_input",
             "embedding_rowwise": "rowwise", "embedding_colwise": "colwise_gather",
             "moe_tp_experts": "experts", "mla_kv_a_proj": "mla_kv_a", "replicate": None}
"""``transformers``' tensor-parallel styles that disttrain honours, and their names here (None: the module stays
whole on every rank, as an unnamed one does)."""
REFUSED_TP_STYLES = {
    "packed_colwise": "splits each packed part (gate and up, or q, k and v) of a fused weight, a strided DTensor "
                      "layout that torch.distributed.checkpoint cannot save (disttrain splits it only inside a "
                      "grouped-experts module, by whole experts)",
    "packed_rowwise": "splits each packed part of a fused weight by its input features, a strided DTensor layout "
                      "that torch.distributed.checkpoint cannot save",
    "local_params": "runs a module on bare parameters that their own entries split (attention sinks, gate biases); "
                    "disttrain splits modules, not bare parameters",
    "all_reduce": "sums a module's output by hand after layers whose own styles already sum theirs in disttrain "
                  "(it would be summed twice)",
    "moe_identity_expert": "scales an identity expert inside the experts by 1/tp; disttrain splits experts whole "
                           "and would add it tp times",
}
"""``transformers``' styles declared by causal LMs that disttrain refuses, and why."""


def _base(net: nn.Module) -> tuple[str, Any]:
    """The base model's attribute name (``model``, ``transformer``) and the base model."""
    prefix = net._model.base_model_prefix
    return prefix, getattr(net, prefix)


def tp_plan(net: nn.Module) -> dict[str, str]:
    """The config's tensor-parallel plan under the network's names and disttrain's styles; ConfigError naming the
    first style disttrain refuses, why, and the rest of the plan as a ``parallel.tp_plan`` to run instead."""
    prefix, _ = _base(net)
    plan = getattr(net.hf_config, "base_model_tp_plan", None) or {}
    # a plan covers every variant of its config; entries naming modules this one lacks (q_proj where a low-rank
    # query is configured, the dense MLP of a model whose every layer is a mixture) are left out, as
    # ``transformers`` skips them
    modules = [name.split(".") for name, _ in net.named_modules() if name]
    parameters = [name.split(".") for name, _ in net.named_parameters()]
    experts = [pattern for pattern, style in plan.items() if style == "moe_tp_experts"]
    declared = {}
    for pattern, style in plan.items():
        parts = f"{prefix}.{pattern}".split(".")
        if any(pattern.rpartition(".")[0] == module for module in experts) and any(
                _matches(name, parts) for name in parameters):
            continue  # an experts module's own parameter: its whole-expert split covers it
        if any(_matches(name, parts) for name in (*modules, *parameters)):
            declared[pattern] = style
    ours = {f"{prefix}.{pattern}": TP_STYLES[style] for pattern, style in declared.items()
            if TP_STYLES.get(style) is not None}
    for pattern, style in declared.items():
        if style not in TP_STYLES:
            why = REFUSED_TP_STYLES.get(style, f"is not one disttrain runs ({sorted(TP_STYLES)})")
            instead = "{" + ",".join(f"{name}:{ours_style}" for name, ours_style in ours.items()) + "}"
            raise ConfigError("parallel.tp", f"{pattern}: {style}", f"1 for model type {net.hf_config.model_type}, "
                              f"or parallel.tp_plan='{instead}' (its declared plan without that entry): style "
                              f"{style} {why}")
    return ours


def _matches(name: list[str], pattern: list[str]) -> bool:
    """A module's or parameter's dotted name matches a plan pattern part by part (``layers.*.mlp``)."""
    return len(name) == len(pattern) and all(fnmatchcase(n, p) for n, p in zip(name, pattern, strict=True))


def layer_lists(net: nn.Module) -> list[str]:
    """The ``ModuleList`` names that hold the model's decoder layers (its never-split classes)."""
    never_split = set(getattr(net._model, "_no_split_modules", None) or ())
    return [name for name, module in net.named_modules()
            if isinstance(module, nn.ModuleList) and len(module) and type(module[0]).__name__ in never_split]


BY_ROWS = ("colwise", "colwise_gather_output", "colwise_rep")
"""``transformers``' styles that split a projection's output features: an attention projection's heads are rows."""
BY_COLUMNS = ("rowwise", "rowwise_split_input", "rowwise_rep")
"""Its styles that split a projection's input features: the output projection's heads are columns."""


def attention_heads(net: nn.Module) -> dict[str, HeadBlocks]:
    """The heads of the attention projections that the config's tensor-parallel plan splits: a column-wise
    projection of an attention module (one with a ``head_dim`` or ``head_size``) holding the query heads, the
    key/value heads or both and the query heads (a fused qkv) stacks them by rows, a row-wise one reading the query
    heads by columns. A model whose config declares no plan (GPT-2) declares no heads, nor does multi-head latent
    attention (DeepSeek), whose projections' heads are not ``head_dim`` wide."""
    prefix, _ = _base(net)
    config = net.hf_config
    query_heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or query_heads
    plan = getattr(config, "base_model_tp_plan", None) or {}
    modules = dict(net.named_modules())
    heads = {}
    for pattern, style in plan.items():
        if style not in (*BY_ROWS, *BY_COLUMNS) or not query_heads:
            continue
        parts = f"{prefix}.{pattern}".split(".")
        for name, module in modules.items():
            parent = modules.get(name.rpartition(".")[0])
            width = getattr(parent, "head_dim", None) or getattr(parent, "head_size", None)  # GPT-NeoX: head_size
            if not (isinstance(module, nn.Linear) and isinstance(width, int) and _matches(name.split("."), parts)):
                continue
            if style in BY_ROWS and module.out_features in (query_heads * width, kv_heads * width,
                                                             (query_heads + 2 * kv_heads) * width):
                heads[f"{name}.weight"] = HeadBlocks(ROWS, width)
            elif style in BY_COLUMNS and module.in_features == query_heads * width:
                heads[f"{name}.weight"] = HeadBlocks(COLUMNS, width)
    return heads
