"""What a rank's activations measure on a CPU, to hold the planner's predictions against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile


def _allocated(prof: profile) -> tuple[int, int]:
    """Bytes the profiled code left allocated, and the most it had allocated at once."""
    in_use = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        in_use += event.self_cpu_memory_usage
        peak = max(peak, in_use)
    return in_use, peak


def measured_activations(net: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, int]:
    """Bytes alive for backward when forward and the loss end, and their peak during backward.

    Read from torch's profiler memory events (``profile_memory=True``): the CPU allocator's own record of every
    allocation and free, summed in time order. It counts what is really held, whatever holds it (autograd's
    saved tensors, a checkpoint's kept inputs, selective checkpointing's cache of outputs), independently of
    the saved-tensor hooks the planner's pass reads. The process's resident memory would not do: the C
    allocator keeps freed pages, and a few MB drown in it. Parameter gradients exist before forward, so what
    backward adds is activations' gradients and recomputed activations.
    """
    inputs, targets = batch
    for p in net.parameters():
        p.grad = torch.zeros_like(p)

    def forward() -> torch.Tensor:
        logits = net(inputs)  # freed on return, as a training step frees it: the loss keeps what it needs
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = forward()
    held, _ = _allocated(prof)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
    return held, held + _allocated(prof)[1]
