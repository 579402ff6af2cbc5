"""What a plan knows of mixture-of-experts layers: which parameters are experts, what torch's grouped matrix
product costs, and how a pass on the meta device gets through routing whose outcome depends on the data.

Experts are the 3-D parameters (``[n_experts, ...]``) of the modules that carry an ``expert_parallel`` attribute,
the mark expert parallelism splits by (``disttrain.parallel.model_checks``); such a module's forward takes the rows
routed to its experts first (``[rows, width]``, sorted by expert) and returns their outputs, or, as
``transformers``' grouped experts do (``disttrain.models.hf.experts``), each token once with the experts it chose
(``experts(hidden, top_k_index, top_k_weights)``) and returns its combined output: a row per token and choice
either way.

Routing on the meta device. A router's choices have no values there, so the pass assumes balanced routing: each
of a layer's E experts receives M / E of its M rows (``bincount``'s counts, when the model copies them off the
device to split the rows by them), and no assignment is dropped for lack of capacity (a boolean mask keeps every
element: an upper bound when a capacity factor below 1 drops some). Most of what a plan reads does not depend on
the balance: a layer computes tokens x top_k rows whichever experts they go to, so its FLOPs, activations and
all-to-all bytes are those of any routing that drops nothing; only which rank works on them does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.fx.experimental import _config as fx_config
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

EXPERT_MARK = "expert_parallel"
"""Attribute of a module holding grouped experts (``disttrain.models.experts.GroupedExperts``)."""


@dataclass
class ExpertCall:
    """One forward of a module of grouped experts."""

    module: str
    """The expert module's name."""
    unit: str
    """The innermost tracked unit it ran in (``ROOT`` if none)."""
    n_experts: int
    """Experts it holds."""
    rows: int
    """Rows it computed (tokens x experts per token, less any dropped)."""
    in_bytes: int
    """Bytes of the rows it received (expert parallelism's dispatch all-to-all moves them)."""
    out_bytes: int
    """Bytes of the rows it returned (the combining all-to-all moves them back)."""


def expert_modules(net: nn.Module) -> dict[str, nn.Module]:
    """Name -> module of every module of ``net`` that holds grouped experts (has an ``expert_parallel``
    attribute)."""
    return {name: module for name, module in net.named_modules() if hasattr(module, EXPERT_MARK)}


def expert_parameters(net: nn.Module) -> dict[str, tuple[str, int]]:
    """Parameter name -> (its expert module's name, experts in it: the size of its first dimension) for each 3-D
    parameter of an expert module."""
    found = {}
    for module_name, module in expert_modules(net).items():
        for name, param in module.named_parameters():
            if param.dim() == 3:
                found[f"{module_name}.{name}" if module_name else name] = (module_name, param.size(0))
    return found


def grouped_mm_flops(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None, *args: object,
                     out_val: torch.Tensor | None = None, **kwargs: object) -> int:
    """FLOPs of ``aten._grouped_mm(a, b, offs)``: 2 x M x K x N over all groups. Every output element sums
    ``a.size(-1)`` products, except in the 2-D x 2-D form (``[M, K] x [K, N] -> [G, M, N]``, the weight gradient),
    whose groups split K between them."""
    if a.dim() == 2 and b.dim() == 2:
        return 2 * a.size(0) * a.size(1) * b.size(1)
    return 2 * out_val.numel() * a.size(-1)


def grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> tuple[int, ...]:
    """The output shape of ``aten._grouped_mm`` (torch's meta kernel gives it for bf16 operands only)."""
    if a.dim() == 2:
        return (offs.size(0), a.size(0), b.size(1)) if b.dim() == 2 else (a.size(0), b.size(-1))
    return (a.size(1), b.size(1)) if b.dim() == 2 else (a.size(0), a.size(1), b.size(-1))


def balanced_counts(rows: int, bins: int) -> list[int]:
    """``rows`` spread over ``bins`` as evenly as whole numbers allow (the first bins take the remainder)."""
    return [rows // bins + (i < rows % bins) for i in range(bins)]


def _on_meta(args: tuple) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_meta for t in tree_leaves(args))


class BalancedRouting(TorchDispatchMode):
    """Runs routing's data-dependent operators on meta tensors (module docstring): ``bincount`` returns
    ``minlength`` bins whose values, copied off the meta device, are the balanced counts; the grouped matrix
    product returns its output shape for any dtype; boolean masks keep every element. Other operators run as
    they would."""

    def __init__(self) -> None:
        super().__init__()
        self._counts: dict[int, tuple[torch.Tensor, list[int]]] = {}
        self._all_kept = fx_config.patch(meta_nonzero_assume_all_nonzero=True)

    def __enter__(self) -> BalancedRouting:
        self._all_kept.__enter__()
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        self._all_kept.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func._overloadpacket
        aten = torch.ops.aten
        if packet is aten.bincount and _on_meta(args):
            return self._bincount(*args, **kwargs)
        if packet is aten._grouped_mm and _on_meta(args):
            a, b, offs = (list(args) + [kwargs.get("offs")])[:3]
            return a.new_empty(grouped_mm_shape(a, b, offs), dtype=kwargs.get("out_dtype") or a.dtype)
        if packet is aten._to_copy and args[0].is_meta and kwargs.get("device") not in (None, torch.device("meta")):
            known = self._counts.get(id(args[0]))
            if known is not None and known[0] is args[0]:
                return torch.tensor(known[1], dtype=kwargs.get("dtype") or args[0].dtype, device=kwargs["device"])
        return func(*args, **kwargs)

    def _bincount(self, values: torch.Tensor, weights: torch.Tensor | None = None, minlength: int = 0
                  ) -> torch.Tensor:
        if minlength < 1 or weights is not None:
            # refused by name, not guessed: a weighted or unbounded count has no output size without its values
            raise ValueError("a plan runs bincount on the meta device only as routing calls it: unweighted, "
                             "with minlength the number of experts (its values are not known there)")
        out = torch.empty(minlength, dtype=torch.int64, device="meta")
        self._counts[id(out)] = (out, balanced_counts(values.numel(), minlength))
        return out
