"""The attention kernels that return a log-sum-exp, each as a forward and its backward behind one calling form, and
the choice among them for a device and dtype.

``forward(q, k, v, causal) -> (out, lse, state)``: ``q [B, H, t, D]`` over ``k, v [B, H, s, D]`` without dropout and
at the default scale; ``lse`` is ``[B, H, t]`` in float32 (float64 for float64 on a CPU), and ``state`` is what the
kernel's backward takes besides (its random state, its sequence bookkeeping). ``backward(grad, q, k, v, out, lse,
state, causal) -> (grad_q, grad_k, grad_v)`` accepts an ``out`` and ``lse`` other than the forward's own (the merged
ones of ``disttrain.parallel.causal_blocks``) in any layout. ``causal`` is only ever asked of a square block, where
the kernels' top-left and bottom-right alignments agree.

On CUDA: the flash kernel for bf16/fp16 (where torch's own dispatch check says it fits: head dim, GPU, the
``torch.backends.cuda`` switches), else the memory-efficient one (fp32 too), else none and the caller takes its
masked form. All are torch's ``_scaled_dot_product_*`` ops, called positionally as their schemas stand in torch
2.11 to 2.13 (2.13 renames the flash kernel's random state, not its place).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

aten = torch.ops.aten


@dataclass(frozen=True)
class AttentionKernel:
    """One attention kernel with a log-sum-exp: its forward and backward in the calling form of this module."""

    name: str
    """What runs (printed by the benchmark, named by tests)."""
    forward: Callable[..., tuple[torch.Tensor, torch.Tensor, tuple[Any, ...]]]
    """``(q, k, v, causal) -> (out, lse [B, H, t], state)``."""
    backward: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    """``(grad, q, k, v, out, lse, state, causal) -> (grad_q, grad_k, grad_v)``."""


def _cpu_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out, lse, ()


def _cpu_backward(grad, q, k, v, out, lse, state, causal):
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, causal)


def _flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal)
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _flash_backward(grad, q, k, v, out, lse, state, causal):
    cum_q, cum_k, max_q, max_k, seed, offset = state
    # the kernel makes grad and out contiguous itself and reads lse as contiguous [B, H, t]
    return aten._scaled_dot_product_flash_attention_backward(grad, q, k, v, out, lse.contiguous(), cum_q, cum_k,
                                                             max_q, max_k, 0.0, causal, seed, offset)


def _efficient_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)
    # its lse is padded along the queries to a multiple of 32 (the kernel's rows per block): the first t are real
    return out, lse[:, :, :q.size(2)], (lse.size(2), seed, offset)


def _efficient_backward(grad, q, k, v, out, lse, state, causal):
    padded, seed, offset = state
    # the padding rows hold +inf as the forward writes them (their probabilities exp(s - inf) are 0)
    lse = F.pad(lse, (0, padded - lse.size(2)), value=math.inf).contiguous()
    # the kernel reads out with a row stride of heads x head dim: the [B, t, H, D] layout its forward writes
    out = out.transpose(1, 2).contiguous().transpose(1, 2)
    grad_q, grad_k, grad_v, _ = aten._scaled_dot_product_efficient_attention_backward(
        grad, q, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal)
    return grad_q, grad_k, grad_v


CPU_FLASH = AttentionKernel("cpu-flash", _cpu_forward, _cpu_backward)
"""torch's CPU flash kernel (every float dtype)."""
CUDA_FLASH = AttentionKernel("cuda-flash", _flash_forward, _flash_backward)
"""FlashAttention-2 as torch builds it (bf16 and fp16)."""
CUDA_EFFICIENT = AttentionKernel("cuda-efficient", _efficient_forward, _efficient_backward)
"""The memory-efficient (cutlass) kernel (fp32, bf16, fp16)."""

FLASH_DTYPES = (torch.bfloat16, torch.float16)
"""The dtypes of the CUDA flash kernel."""
EFFICIENT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes of the CUDA memory-efficient kernel."""


def pick_kernel(device_type: str, dtype: torch.dtype, flash_fits: bool = True,
                efficient_fits: bool = True) -> AttentionKernel | None:
    """The kernel for tensors of ``dtype`` on ``device_type``, or None (the caller's masked form): on a CPU its
    flash kernel; on CUDA the flash kernel for bf16/fp16 where it fits, else the memory-efficient one where that
    fits. ``*_fits``: the rest of each CUDA kernel's limits (head dim, GPU, switches) hold for these inputs."""
    if device_type == "cpu":
        return CPU_FLASH
    if device_type != "cuda":
        return None
    if dtype in FLASH_DTYPES and flash_fits:
        return CUDA_FLASH
    if dtype in EFFICIENT_DTYPES and efficient_fits:
        return CUDA_EFFICIENT
    return None


def kernel_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> AttentionKernel | None:
    """The kernel that runs queries ``q`` over keys ``k`` and values ``v`` (``[B, H, *, D]``, as many heads), or
    None: with dropout (the backward would have to replay each part's mask), or where no kernel fits."""
    if dropout_p != 0.0:
        return None
    if q.device.type != "cuda":
        return pick_kernel(q.device.type, q.dtype)
    # torch's own dispatch checks, for the non-causal call over all keys (the larger of the two parts)
    params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, False, False)
    return pick_kernel("cuda", q.dtype, torch.backends.cuda.can_use_flash_attention(params),
                       torch.backends.cuda.can_use_efficient_attention(params))
