"""``trainer.precision=auto``: bf16 autocast where it is native and, on a CPU, measured faster on this model.

A CPU's bf16 instructions do not settle it: on a small GPT, bf16 autocast ran faster than fp32 on an AMD
EPYC with AVX512-BF16, slower on an Intel Xeon with AMX (the casts around small matrices cost more than the
products save), and far slower where bf16 is emulated (benchmarks/README.md, Figures cited elsewhere). So a CPU
with native bf16 times a few steps of the run's own model both ways, before any rank starts.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F

from disttrain.data.spec import DataSpec, example_batch
from disttrain.plan.devices import native_bf16

PROBE_STEPS = 3
"""Timed forward and backward passes per precision (after one untimed warm-up)."""
REQUIRED_SPEEDUP = 1.05
"""bf16 autocast must be at least this much faster than fp32 to be chosen (fp32 is the exact one)."""

MATMUL_PRECISIONS = ("auto", "highest", "high", "medium")
"""``trainer.matmul_precision``: auto, or ``torch.set_float32_matmul_precision``'s three."""


def resolve_matmul_precision(precision: str, uses_gpu: bool) -> str:
    """``trainer.matmul_precision`` as torch names it: ``auto`` is high (TF32) on a GPU, highest on a CPU."""
    if precision != "auto":
        return precision
    return "high" if uses_gpu else "highest"


def step_seconds(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], bf16: bool) -> float:
    """Mean seconds of a forward and backward pass on ``batch``, under bf16 autocast or in fp32."""
    inputs, targets = batch
    timed = 0.0
    for step in range(PROBE_STEPS + 1):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(inputs)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        loss.backward()
        timed += (time.perf_counter() - start) if step else 0.0
    model.zero_grad(set_to_none=True)
    return timed / PROBE_STEPS


def resolve_precision(precision: str, uses_gpu: bool, model_cfg: Any, spec: DataSpec, micro_size: int
                      ) -> tuple[str, str | None]:
    """``precision`` as Lightning's name, and a one-line notice saying why when ``auto`` chose it."""
    if precision != "auto":
        return precision, None
    native, found = native_bf16(uses_gpu)
    if not native or uses_gpu:
        chosen = "bf16-mixed" if native else "32-true"
        return chosen, f"trainer.precision=auto: {chosen} ({found})"
    from disttrain.models import build_model

    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = build_model(model_cfg, spec)
        if any(p.is_meta for p in model.parameters()):  # its weights come from a checkpoint later: any will time
            model.materialize(torch.device("cpu"))
            for p in model.parameters():
                torch.nn.init.normal_(p, std=0.02)
        batch = example_batch(spec, micro_size)
        fp32, bf16 = step_seconds(model, batch, bf16=False), step_seconds(model, batch, bf16=True)
    speedup = fp32 / bf16
    chosen = "bf16-mixed" if speedup >= REQUIRED_SPEEDUP else "32-true"
    return chosen, (f"trainer.precision=auto: {chosen} ({found}; bf16 autocast measured {speedup:.2f}x the "
                    f"speed of fp32 on this model, {REQUIRED_SPEEDUP:.2f}x needed)")
