"""Causal attention under bf16 on this CPU: torch's bf16 kernel against attending in fp32 (cast up and back).

    python benchmarks/attention_dtype.py [--threads 2] [--calls 200]

Times forward and backward of ``disttrain.models.attention.causal_attention`` on bf16 inputs ``[B, H, T, D]``
both ways, with the fp32 kernel on fp32 inputs beside them, at the shapes of disttrain's GPT and Llama
flavours and a few longer ones. The last column is what ``attention_fp32=None`` picks at that shape; the rule
is right where that column names the faster of the two bf16 columns.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from machine import cpu_features, cpu_model  # noqa: E402

from disttrain.models.attention import attends_in_fp32, causal_attention  # noqa: E402

SHAPES = [(12, 2, 32, 16), (12, 4, 64, 32), (12, 4, 128, 32), (12, 4, 128, 64), (12, 4, 64, 128),
          (12, 4, 256, 32), (8, 6, 256, 64), (4, 12, 512, 64)]
"""(batch, heads, sequence, head width): GPT micro and nano first, then longer sequences and wider heads."""


def microseconds(shape: tuple[int, ...], dtype: torch.dtype, fp32: bool | None, calls: int) -> float:
    """Mean microseconds of one forward and backward of causal attention on random inputs of ``shape``."""
    q, k, v = (torch.randn(shape, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, dtype=dtype)

    def once() -> None:
        causal_attention(q, k, v, fp32=fp32).backward(grad)

    for _ in range(max(calls // 10, 3)):
        once()
    start = time.perf_counter()
    for _ in range(calls):
        once()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"CPU: {cpu_model()} ({cpu_features()}), {args.threads} threads, torch {torch.__version__}\n")
    print("| B, H, T, D | fp32 (us) | bf16 kernel (us) | bf16 in fp32 (us) | bf16 kernel / in fp32 | rule picks |")
    print("|---|---:|---:|---:|---:|---|")
    for shape in SHAPES:
        calls = max(args.calls * 64 * 32 // (shape[2] * shape[3]), 10)
        fp32 = microseconds(shape, torch.float32, None, calls)
        native = microseconds(shape, torch.bfloat16, False, calls)
        upcast = microseconds(shape, torch.bfloat16, True, calls)
        picks = "fp32" if attends_in_fp32(torch.empty(shape, dtype=torch.bfloat16)) else "bf16 kernel"
        print(f"| {', '.join(map(str, shape))} | {fp32:,.0f} | {native:,.0f} | {upcast:,.0f} | "
              f"{native / upcast:.2f} | {picks} |")


if __name__ == "__main__":
    main()
