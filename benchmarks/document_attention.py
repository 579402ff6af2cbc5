"""Attention within packed documents on this CPU: one call with a block-diagonal boolean mask against one causal
call per document, with plain causal attention over the whole window (no document mask) beside them.

    python benchmarks/document_attention.py [--threads 2] [--calls 20]

Times forward and backward on fp32 inputs ``[B, H, T, D]`` whose windows hold documents of random lengths (a
geometric spread around the mean length of each row), checks that both ways agree, and prints the ratio of the
per-document calls' time to the masked call's: above 1, the mask (``disttrain.models.documents``) is the faster.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from machine import cpu_features, cpu_model  # noqa: E402

from disttrain.models.attention import document_attention  # noqa: E402

SHAPES = [(8, 4, 256, 32, 64), (8, 6, 512, 64, 128), (4, 12, 1024, 64, 256), (2, 12, 2048, 64, 512)]
"""(batch, heads, window, head width, mean document length): GPT nano-sized to GPT-2-sized windows."""


def document_ids_of(batch: int, window: int, mean_length: int, generator: torch.Generator) -> torch.Tensor:
    """Document ids ``[B, T]`` of windows packed from documents whose lengths are drawn around ``mean_length``."""
    rows = []
    for _ in range(batch):
        lengths = []
        while sum(lengths) < window:
            lengths.append(int(torch.empty(1).exponential_(1 / mean_length, generator=generator).item()) + 1)
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:window]
        rows.append(ids)
    return torch.stack(rows)


def per_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Causal attention of each document of each row on its own, the outputs put back in order."""
    rows = []
    for b in range(q.size(0)):
        lengths = torch.unique_consecutive(ids[b], return_counts=True)[1].tolist()
        parts = zip(q[b:b + 1].split(lengths, 2), k[b:b + 1].split(lengths, 2), v[b:b + 1].split(lengths, 2),
                    strict=True)
        rows.append(torch.cat([F.scaled_dot_product_attention(*part, is_causal=True) for part in parts], dim=2))
    return torch.cat(rows)


def milliseconds(attend, q, k, v, calls: int) -> tuple[float, torch.Tensor]:
    """Mean milliseconds of one forward and backward of ``attend(q, k, v)``, and its output."""
    grad = torch.ones_like(q)
    for _ in range(2):
        attend(q, k, v).backward(grad)
    start = time.perf_counter()
    for _ in range(calls):
        out = attend(q, k, v)
        out.backward(grad)
    return (time.perf_counter() - start) / calls * 1e3, out.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    print(f"CPU: {cpu_model()} ({cpu_features()}), {args.threads} threads, torch {torch.__version__}\n")
    print("| B, H, T, D | mean document | documents | causal, no mask (ms) | masked call (ms) | per document (ms) "
          "| per document / masked | max difference |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    ratios = []
    for b, h, t, d, mean_length in SHAPES:
        q, k, v = (torch.randn(b, h, t, d, requires_grad=True) for _ in range(3))
        ids = document_ids_of(b, t, mean_length, generator)
        calls = max(args.calls * 1024 // t, 3)
        plain, _ = milliseconds(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                q, k, v, calls)
        masked, out_masked = milliseconds(lambda q, k, v, ids=ids: document_attention(q, k, v, ids), q, k, v,
                                          calls)
        looped, out_looped = milliseconds(lambda q, k, v, ids=ids: per_document_attention(q, k, v, ids), q, k,
                                          v, calls)
        ratios.append(looped / masked)
        documents = int((ids[:, -1] + 1).sum())
        difference = (out_masked - out_looped).abs().max().item()
        print(f"| {b}, {h}, {t}, {d} | {mean_length} | {documents} | {plain:.2f} | {masked:.2f} | {looped:.2f} "
              f"| {looped / masked:.2f} | {difference:.1e} |")
    print(f"\nper-document calls / masked call, geometric mean over shapes: "
          f"{torch.tensor(ratios).log().mean().exp().item():.2f}x")


if __name__ == "__main__":
    main()
