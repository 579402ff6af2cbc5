"""Causal attention of query chunks over the keys before them, with no mask: an attention kernel that returns a
log-sum-exp (``disttrain.parallel.attention_kernels``: torch's CPU flash kernel, CUDA's flash or memory-efficient
one) on two parts per chunk, merged by their log-sum-exp.

A chunk of ``c`` queries at positions ``[s, s + c)`` sees keys ``[0, s + c)``: the keys before it are all visible
(one call without a mask) and its own ``c`` keys are visible causally (one call with ``is_causal``, whose top-left
and bottom-right alignments agree for a square block, so every kernel is right there). A boolean mask over
``[0, s + c)`` would do the same in one call, but the kernel turns it into a float matrix of ``c x (s + c)`` (64 MB
for a chunk of 2,048 queries at 8,192 tokens, per layer) and skips none of the masked work; here memory stays linear
in the sequence and each part does only its own work.

The two parts' outputs ``o_a, o_b`` with log-sum-exps ``l_a, l_b`` merge as softmax over the union would:
``l = log(e^l_a + e^l_b)``, ``o = e^(l_a - l) o_a + e^(l_b - l) o_b``. Backward runs the kernel's own backward on
each part with the merged ``o`` and ``l`` (the probabilities it rebuilds, ``exp(scores - l)``, are then those of
the union, and its ``rowsum(dO * O)`` term is the union's), and adds the parts' gradients in float32 or wider: the
method of FlashAttention-2's backward and of ring attention, over torch's kernels (``torch.ops.aten`` exposes their
forwards with the log-sum-exp and their backwards; ``F.scaled_dot_product_attention`` returns neither).
"""

from __future__ import annotations

from typing import Any

import torch

from disttrain.parallel.attention_kernels import AttentionKernel, kernel_for

Part = tuple[int, int, bool]
"""Keys ``[start, end)`` of the whole sequence that a chunk attends, and whether causally (its diagonal)."""


def chunk_parts(chunk_start: int, chunk_length: int) -> list[Part]:
    """The parts of a chunk of queries at ``[chunk_start, chunk_start + chunk_length)``: the keys before it
    (unmasked; none for the first chunk) and its own (causal)."""
    diagonal = (chunk_start, chunk_start + chunk_length, True)
    return [(0, chunk_start, False), diagonal] if chunk_start else [diagonal]


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> AttentionKernel | None:
    """The kernel this path runs these inputs with, or None where it cannot (dropout: a part's backward would have
    to replay its mask; a device or dtype without a kernel; limits a CUDA kernel does not meet)."""
    return kernel_for(q, k, v, dropout_p)


class CausalChunks(torch.autograd.Function):
    """``[B, H, t, D]`` queries, as chunks each at its own start in the sequence, over the whole sequence's keys
    and values ``[B, H, T, D]``, with ``kernel`` (from ``supported``); returns ``[B, H, t, D]``."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: list[tuple[slice, int]],
                kernel: AttentionKernel) -> torch.Tensor:
        outputs, lses, states = [], [], []
        merge = torch.promote_types(q.dtype, torch.float32)  # bf16 outputs are weighted in fp32
        for rows, start in chunks:
            q_chunk = q[:, :, rows]
            parts = [kernel.forward(q_chunk, k[:, :, a:b], v[:, :, a:b], causal)
                     for a, b, causal in chunk_parts(start, q_chunk.size(2))]
            lse = parts[0][1] if len(parts) == 1 else torch.logaddexp(parts[0][1], parts[1][1])
            out = sum(o.to(merge) * torch.exp(part_lse - lse).unsqueeze(-1).to(merge) for o, part_lse, _ in parts)
            outputs.append(out.to(q.dtype))
            lses.append(lse)
            states.append([state for _, _, state in parts])
        out = torch.cat(outputs, dim=2)
        # the states are the kernels' random-state scalars and sequence bookkeeping: small, and never gradients
        ctx.chunks, ctx.kernel, ctx.states = chunks, kernel, states
        ctx.save_for_backward(q, k, v, out, *lses)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q, k, v, out, *lses = ctx.saved_tensors
        # the keys of early chunks take a part from every later chunk: summed in fp32 where the inputs are narrower
        wide = torch.promote_types(q.dtype, torch.float32)
        grad_q, grad_k, grad_v = (torch.zeros_like(x, dtype=wide) for x in (q, k, v))
        for (rows, start), lse, states in zip(ctx.chunks, lses, ctx.states, strict=True):
            q_chunk, g_chunk, o_chunk = q[:, :, rows], grad[:, :, rows].contiguous(), out[:, :, rows]
            for (a, b, causal), state in zip(chunk_parts(start, q_chunk.size(2)), states, strict=True):
                gq, gk, gv = ctx.kernel.backward(g_chunk, q_chunk, k[:, :, a:b], v[:, :, a:b], o_chunk, lse, state,
                                                 causal)
                grad_q[:, :, rows] += gq
                grad_k[:, :, a:b] += gk
                grad_v[:, :, a:b] += gv
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None
