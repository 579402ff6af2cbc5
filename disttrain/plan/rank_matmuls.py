"""The matrix products one rank runs, recorded once and replayed: this process's matrix-multiply rate at the
rank's own shapes, strides and dtypes, for pricing a plan on the machine a dry run runs on.

A rate measured on one square product (``calibrate.measure_compute``'s 1024 x 1024) is not the rate of a model's
products: a CPU runs a thin product (few tokens, a narrow width) at a fraction of a square one's rate, and a short
measurement on a shared machine catches whatever else runs then. Replaying the rank's own products, interleaved
with its timed steps, prices the plan at the rate its steps met, on the same threads, under the same load.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from disttrain.plan.ops import FLOP_REGISTRY, MATMUL_OPS, flop_formula

_aten = torch.ops.aten
FIRST_FACTOR = {_aten.mm: 0, _aten.addmm: 1, _aten.bmm: 0, _aten.baddbmm: 1, _aten._scaled_mm: 0, _aten._grouped_mm: 0}
"""Position of each product's left factor among its arguments (``addmm`` and ``baddbmm`` take the added term
first)."""


def product_flops(op: Any, args: tuple, out: torch.Tensor) -> int:
    """FLOPs of one matrix product: 2 x the output's elements x the inner dimension (the left factor's last),
    counted here from the shapes rather than by the formulas the plan counts with, so that a plan miscounting
    its products does not cancel against its own count in the rate. A grouped product of two matrices (an expert
    stack's weight gradient, ``[M, K] x [K, N] -> [G, M, N]``) splits the inner dimension between its groups."""
    if op._overloadpacket is _aten._grouped_mm and args[0].dim() == 2 and args[1].dim() == 2:
        return 2 * args[0].shape[0] * args[0].shape[1] * args[1].shape[1]
    return 2 * out.numel() * args[FIRST_FACTOR[op._overloadpacket]].shape[-1]


@dataclass(frozen=True)
class TensorSpec:
    """A tensor argument as a replay rebuilds it."""

    shape: tuple[int, ...]
    """Its size."""
    stride: tuple[int, ...]
    """Its strides (a linear layer's weight arrives transposed, which decides the kernel)."""
    dtype: torch.dtype
    """Its dtype."""
    values: tuple | None = None
    """The values of an integer argument (a grouped product's offsets, which decide its work), as a flat tuple
    (a recording allocates no tensor: it runs under the dry run's byte counter); None for floating-point ones,
    which a replay fills with random values."""

    def build(self) -> torch.Tensor:
        """A tensor of this shape, stride and dtype (with the recorded values for integer arguments)."""
        if self.values is not None:
            return torch.tensor(self.values, dtype=self.dtype).reshape(self.shape)
        return torch.empty_strided(self.shape, self.stride, dtype=self.dtype).normal_(0.0, 0.02)


@dataclass(frozen=True)
class MatmulCall:
    """One matrix product as the dispatcher saw it: the operator and its arguments' specs (non-tensor arguments
    as they were)."""

    op: Any
    """The ``torch.ops.aten`` overload."""
    args: tuple
    """Positional arguments, tensors as ``TensorSpec``."""
    kwargs: tuple
    """Keyword arguments as sorted (name, value) pairs, tensors as ``TensorSpec``."""


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard (what this rank multiplies), else the tensor."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _local_or_value(value: Any) -> Any:
    return _local(value) if isinstance(value, torch.Tensor) else value


def _spec(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    local = _local(value)
    return TensorSpec(tuple(local.shape), tuple(local.stride()), local.dtype,
                      None if local.is_floating_point() else tuple(local.flatten().tolist()))


class MatmulRecorder(TorchDispatchMode):
    """Records each matrix product (``ops.MATMUL_OPS``) run under it, with how many times it ran (``calls``), and
    the FLOPs of the products and of the other operators the plan counts that this rank ran (its local shards'
    shapes)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[MatmulCall] = Counter()
        """Each distinct product -> how many times it ran."""
        self.matmul_flops = 0
        """FLOPs of the products (``product_flops``)."""
        self.other_flops = 0
        """FLOPs of the other operators the plan counts: fused attention forward and backward, convolutions, the
        4-bit products of a quantised base (the plan's formulas: no product of theirs reaches the dispatcher)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        if packet in MATMUL_OPS:
            self.calls[MatmulCall(func, tuple(_spec(a) for a in args),
                                  tuple(sorted((k, _spec(v)) for k, v in kwargs.items())))] += 1
            self.matmul_flops += product_flops(func, tree_map(_local_or_value, args), _local(out))
        elif (formula := flop_formula(FLOP_REGISTRY, packet)) is not None:  # attention, convolutions, 4-bit products
            self.other_flops += formula(*tree_map(_local_or_value, args), **tree_map(_local_or_value, kwargs),
                                        out_val=tree_map(_local_or_value, out))
        return out

    @property
    def flops(self) -> int:
        """FLOPs of the recorded step: products, attention and convolutions."""
        return self.matmul_flops + self.other_flops


class MatmulReplay:
    """The recorded products with their tensors built once; ``seconds()`` runs them all as often as they ran."""

    def __init__(self, calls: Counter[MatmulCall]) -> None:
        def build(value: Any) -> Any:
            return value.build() if isinstance(value, TensorSpec) else value

        self.calls = [(call.op, tree_map(build, call.args), {k: build(v) for k, v in call.kwargs}, count)
                      for call, count in calls.items()]
        self.flops = 0.0
        """FLOPs of one replay (``product_flops``)."""
        with torch.no_grad():
            for op, args, kwargs, count in self.calls:
                self.flops += count * product_flops(op, args, op(*args, **kwargs))

    def seconds(self) -> float:
        """Wall time of one replay of every recorded product."""
        with torch.no_grad():
            start = time.perf_counter()
            for op, args, kwargs, count in self.calls:
                for _ in range(count):
                    op(*args, **kwargs)
            return time.perf_counter() - start

