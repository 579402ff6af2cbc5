"""Causal scaled dot-product attention that runs in fp32 where torch's bf16 kernel is the slow one.

torch's CPU flash-attention backward in bf16 is slower than in fp32 at short sequences and narrow heads:
measured with ``benchmarks/attention_dtype.py`` on an Intel Xeon with AMX (2 threads, forward and backward),
the bf16 kernel took 4.3x the time of attending in fp32 at T=64, head 32 and 1.8x at T=128, head 64, while
at T=256, head 64 it was 1.15x faster and at T=512, head 64 1.5x. Training a GPT of width 128 (batch 12 x 64),
bf16 autocast ran at 0.65x of fp32 with that kernel and at 1.19x without it. So under bf16 a CPU attention
with ``T * head_dim`` below ``FP32_BELOW`` casts its inputs up, attends in fp32 and casts the result back;
every matrix product around it stays bf16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP32_BELOW = 16384
"""On a CPU, bf16 attention with sequence length times head width below this runs in fp32 (see above)."""


def attends_in_fp32(q: torch.Tensor, fp32: bool | None = None) -> bool:
    """Whether attention on queries ``q`` ``[B, H, T, D]`` runs in fp32.

    ``fp32`` True or False forces the choice for bf16 inputs; None applies the CPU rule of this module.
    Inputs that are not bf16 attend in their own dtype.
    """
    if q.dtype != torch.bfloat16:
        return False
    if fp32 is not None:
        return fp32
    return q.device.type == "cpu" and q.size(-2) * q.size(-1) < FP32_BELOW


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, fp32: bool | None = None
) -> torch.Tensor:
    """Causal ``scaled_dot_product_attention`` of ``[B, H, T, D]`` inputs, in fp32 where ``attends_in_fp32``."""
    if not attends_in_fp32(q, fp32):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    # autocast would cast the fp32 inputs straight back to bf16: attention is on its lower-precision list
    with torch.autocast(q.device.type, enabled=False):
        y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), dropout_p=dropout_p, is_causal=True)
    return y.to(q.dtype)
