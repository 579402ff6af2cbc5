"""The grouped experts of a Hugging Face mixture of experts, under disttrain's expert parallelism.

``transformers`` 5.x keeps each mixture layer's experts in one module of grouped weights (``gate_up_proj``
``[n_experts, 2 x intermediate, hidden]``, ``down_proj`` ``[n_experts, hidden, intermediate]``, for Mixtral,
Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and the others decorated with ``use_experts_implementation``) and names those
modules in its config's ``base_model_ep_plan`` (style ``ep_dispatch_experts``, their weights ``grouped_gemm``:
split on the expert dimension). ``take_expert_parallel`` gives each such module the protocol's ``n_experts`` and
``expert_parallel`` attributes (``disttrain.models.protocol``) and a forward that reads the latter.

The router stays the model's own and every rank keeps it whole. With every expert on the rank (``expert_parallel``
None), the forward is the model's own experts implementation. Split over the ep ranks, it does what
``transformers``' own all-to-all dispatch does (``transformers.distributed.expert_parallel.AllToAllEP``) through
disttrain's exchange: each (token, chosen expert) row goes to the rank holding the expert, where the model's own
experts implementation computes it on this rank's experts (local expert ids, unit weights), and comes back to be
weighted by the router and summed per token.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

EXPERTS_STYLE = "ep_dispatch_experts"
"""The ``base_model_ep_plan`` style of a module of grouped experts that takes routed tokens."""


def grouped_experts(model: nn.Module) -> dict[str, nn.Module]:
    """Name -> module of the grouped experts the config's ``base_model_ep_plan`` names (``ep_dispatch_experts``)
    whose every own parameter is ``[n_experts, ...]``: the modules expert parallelism can split."""
    plan = getattr(model.config, "base_model_ep_plan", None) or {}
    patterns = [pattern.split(".") for pattern, style in plan.items() if style == EXPERTS_STYLE]
    prefix = f"{model.base_model_prefix}."
    found = {}
    for name, module in model.named_modules():
        parts = name.removeprefix(prefix).split(".")
        named = any(len(parts) == len(p) and all(map(fnmatchcase, parts, p)) for p in patterns)
        if named and _holds_grouped_weights(module):
            found[name] = module
    return found


def _holds_grouped_weights(module: nn.Module) -> bool:
    """Whether ``module`` is a ``transformers`` experts module whose own parameters all split on dim 0."""
    count = getattr(module, "num_experts", None)
    params = list(module.parameters(recurse=False))
    return (hasattr(module, "_is_expert_parallel") and isinstance(count, int) and bool(params)
            and all(p.dim() >= 2 and p.size(0) == count for p in params))


def take_expert_parallel(model: nn.Module) -> None:
    """Give the grouped experts of ``model`` (a ``transformers`` model) the protocol's ``n_experts`` and
    ``expert_parallel`` attributes, ``n_experts_key`` (the config key that sets the count, named in messages) and
    the forward that exchanges rows once expert parallelism sets ``expert_parallel``."""
    key = f"model.{experts_field(model.config)}"
    for module in grouped_experts(model).values():
        module.n_experts = module.num_experts
        module.n_experts_key = key
        module.expert_parallel = None
        # bound to the module, so a copy of the model (a pipeline stage) binds it to the copy
        module.forward = types.MethodType(_experts_forward, module)


def experts_field(config: Any) -> str:
    """The field of ``config`` that holds its expert count, as a user sets it (``num_local_experts``,
    ``num_experts``, ``n_routed_experts``): the one an experts module reads, through the config's aliases."""
    stored = config.to_dict()
    # the names transformers' experts modules read the count by; the config's attribute_map aliases them
    for name in ("num_local_experts", "num_experts"):
        field = config.attribute_map.get(name, name)
        if field in stored:
            return field
    return "num_experts"


def _experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor) -> torch.Tensor:
    """The experts' output ``[tokens, hidden]`` for ``hidden_states`` ``[tokens, hidden]`` routed to the experts
    ``top_k_index`` with weights ``top_k_weights`` (both ``[tokens, top_k]``, global expert ids)."""
    exchange = self.expert_parallel
    if exchange is None:
        return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
    top_k = top_k_index.size(-1)
    expert_ids = top_k_index.reshape(-1)
    order = torch.argsort(expert_ids, stable=True)  # rows grouped by expert, so by the rank that holds it
    counts = torch.bincount(expert_ids, minlength=self.n_experts)
    local = {name: exchange.local_weight(param) for name, param in self.named_parameters(recurse=False)}

    def compute(rows: torch.Tensor, local_counts: torch.Tensor) -> torch.Tensor:
        return _local_experts(self, local, rows, local_counts)

    computed = exchange.exchange(hidden_states[order // top_k], counts, compute)
    back = torch.empty_like(order)
    back[order] = torch.arange(order.numel(), device=order.device)
    per_slot = computed[back].view(*top_k_index.shape, -1)  # [tokens, top_k, hidden]
    return (per_slot * top_k_weights.unsqueeze(-1)).sum(dim=1).to(hidden_states.dtype)


def _local_experts(module: nn.Module, local: dict[str, torch.Tensor], rows: torch.Tensor,
                   counts: torch.Tensor) -> torch.Tensor:
    """The model's own experts implementation on this rank's experts (``local`` weights): ``rows`` sorted by local
    expert, ``counts[e]`` for local expert ``e``, each computed by its one expert with weight 1."""
    expert_ids = torch.arange(counts.numel(), device=rows.device).repeat_interleave(counts).unsqueeze(-1)
    with _holding(module, local):
        if rows.size(0) == 0:
            # no rows came: one zero row keeps the weights in backward, so every rank reduces their gradients
            zero_row = rows.sum(0, keepdim=True)
            return type(module).forward(module, zero_row, expert_ids.new_zeros(1, 1), zero_row.new_ones(1, 1))[:0]
        return type(module).forward(module, rows, expert_ids, rows.new_ones(rows.size(0), 1))


@contextmanager
def _holding(module: nn.Module, local: dict[str, torch.Tensor]) -> Iterator[None]:
    """Within the context ``module`` holds only this rank's experts: ``local`` as its weights and their count."""
    saved, count = dict(module._parameters), module.num_experts
    module._parameters.update(local)
    module.num_experts = next(iter(local.values())).size(0)
    try:
        yield
    finally:
        module._parameters.update(saved)
        module.num_experts = count
