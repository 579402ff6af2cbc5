"""The operators of the planner's pass: what each costs (FLOPs by torch's formulas, bytes read and written)
and of which kind it is, counted as they run; and attention run as the fused kernels run it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from disttrain.parallel import activation_checkpoint
from disttrain.plan.experts import grouped_mm_flops

Op = tuple[int, int, bool, str]
"""One operator: FLOPs, bytes read and written, whether it is a convolution (CPUs run those well below
their matrix-multiply rate, so a profile times them at a rate of their own), and its kind (``op_kind``)."""
CONVOLUTIONS = {torch.ops.aten.convolution, torch.ops.aten.convolution_backward}
"""Convolution operators (timed at a profile's convolution rate)."""
# the operator sets of the runtime's selective policy, so the plan prices exactly what it keeps
MATMUL_OPS, ATTENTION_OPS = activation_checkpoint.MATMUL_OPS, activation_checkpoint.ATTENTION_OPS
SELECTIVE_SAVE_OPS = MATMUL_OPS | ATTENTION_OPS
"""Operators whose outputs selective activation checkpointing keeps (``parallel.activation_checkpoint``'s
collectives run only under tensor parallelism, which a measured pass leaves out); it recomputes the others."""
KINDS = ("matmul", "attention", "other")
"""Kinds of operator a pass tells apart (``op_kind``)."""
_aten = torch.ops.aten
FLOP_REGISTRY = {
    **flop_registry,
    # the CPU kernel's FLOPs are those of the CUDA one (same arguments first)
    _aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[_aten._scaled_dot_product_flash_attention],
    _aten._scaled_dot_product_flash_attention_for_cpu_backward:
        flop_registry[_aten._scaled_dot_product_flash_attention_backward],
    _aten._grouped_mm: grouped_mm_flops,
}
"""torch's FLOP formulas, with the CPU attention kernels and the grouped matrix product of experts."""


def quantised_matmul_flops(a: torch.Tensor, b: torch.Tensor, shape_b: list[int], *args: Any, out_val: Any = None,
                           **kwargs: Any) -> int:
    """FLOPs of bitsandbytes' product of ``a`` (``[..., K]``) and a 4-bit weight of ``shape_b`` (``[N, K]``):
    those of the product with the dequantised weight, 2 x M x N x K."""
    n, k = shape_b
    return 2 * (a.numel() // k) * n * k


LIBRARY_FLOPS = {"bitsandbytes::gemm_4bit": quantised_matmul_flops}
"""FLOP formulas of other libraries' operators, by qualified name (their library need not be loaded to name them):
the 4-bit product of QLoRA's base (``disttrain.models.nf4``), whose dequantised weight no aten product sees."""


def flop_formula(registry: dict, packet: Any) -> Any:
    """The FLOP formula of an operator overload packet: ``registry``'s (torch's formulas), else ``LIBRARY_FLOPS``'
    by its qualified name; None: it counts none."""
    return registry.get(packet) or LIBRARY_FLOPS.get(getattr(packet, "_qualified_op_name", ""))


def op_kind(packet: Any) -> str:
    """``matmul``, ``attention`` or ``other`` (element-wise work, norms, copies, views, convolutions) for an
    operator overload packet (``func._overloadpacket`` of an ``OpOverload``)."""
    if packet in MATMUL_OPS:
        return "matmul"
    return "attention" if packet in ATTENTION_OPS else "other"


class FusedAttention(torch.overrides.TorchFunctionMode):
    """Runs ``scaled_dot_product_attention`` as the fused CPU kernel, whose meta implementation saves what
    fused kernels save (on the meta device the dispatcher would pick the reference path, which keeps a tokens x
    tokens matrix per head). Grouped-query attention too: with ``enable_gqa`` (``transformers``' SDPA attention
    passes it rather than repeating the key and value heads) the kernel takes keys and values with fewer heads,
    as the flash kernels of CPUs and GPUs do. Values narrower than the queries and keys (multi-head latent
    attention: DeepSeek's 128 against 192) take the memory-efficient kernel, as torch picks it on a GPU where
    the flash kernels want one head width; it keeps the same (output and log-sum-exp), with keys and values of
    every head."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = ("attn_mask", "dropout_p", "is_causal", "scale")
        options = dict(zip(names, args[3:], strict=False)) | {k: v for k, v in kwargs.items() if k in names}
        query, key, value = args[:3]
        mask = additive_mask(options.get("attn_mask"), query.dtype)
        dropout, causal = options.get("dropout_p", 0.0), options.get("is_causal", False)
        if value.size(-1) != query.size(-1):
            groups = query.size(-3) // key.size(-3)
            key, value = (t.repeat_interleave(groups, dim=-3) if groups > 1 else t for t in (key, value))
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, mask, True, dropout, causal, scale=options.get("scale"))[0]
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p=dropout, is_causal=causal, attn_mask=mask, scale=options.get("scale"))
        return out


def additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``mask`` as a fused kernel receives it: a boolean mask (True: attend) becomes an additive one of the
    queries' ``dtype`` (0 or -inf), as torch's ``scaled_dot_product_attention`` makes it before any kernel on CPUs
    and GPUs alike; each call makes its own, which the kernel keeps for backward (a sliding window's mask is
    such a tokens x tokens tensor per layer)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.where(mask.logical_not(), float("-inf"), torch.zeros((), dtype=dtype, device=mask.device))


class OpCounter(TorchDispatchMode):
    """Reports each operator as an ``Op``: FLOPs by the formulas of ``registry`` and ``LIBRARY_FLOPS``, the bytes
    it reads and writes (views: none), its kind; and, to ``on_call``, its kind, ``(args, kwargs)`` and outputs."""

    def __init__(self, registry: dict, on_op, on_call=None) -> None:
        super().__init__()
        self.registry, self.on_op, self.on_call = registry, on_op, on_call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        formula = flop_formula(self.registry, packet)
        flops = formula(*args, **kwargs, out_val=out) if formula is not None else 0
        nbytes = 0 if func.is_view else sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out))
                                             if isinstance(t, torch.Tensor))
        kind = op_kind(packet)
        self.on_op((int(flops), nbytes, packet in CONVOLUTIONS, kind))
        if self.on_call is not None:
            self.on_call(kind, (args, kwargs), out)
        return out


def count_ops(fn) -> list[Op]:
    """Each operator ``fn()`` runs (for calibrating a profile on the same accounting)."""
    ops: list[Op] = []
    with OpCounter(flop_registry, ops.append):
        fn()
    return ops
