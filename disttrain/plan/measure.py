"""What a rank's activations measure on a CPU, to hold the planner's predictions against."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from disttrain.observe.tensor_bytes import LiveStorages


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy of ``logits`` ``[..., classes]`` against ``targets`` ``[...]``, as a step takes it."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def measured_activations(net: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                         autocast: torch.dtype | None = None,
                         loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cross_entropy
                         ) -> tuple[int, int]:
    """Bytes alive for backward when forward and the loss end, and the most alive at once during backward
    (``LiveStorages``: every storage that forward and backward create, from its creation to its release;
    parameters and their gradients exist before and are not counted). It counts what is really held, whatever
    holds it (autograd's saved tensors, a checkpoint's kept inputs, selective checkpointing's cache of outputs,
    a collective's buffers), independently of the saved-tensor hooks the planner's pass reads. The process's
    resident memory would not do: the C allocator keeps freed pages, and a few MB drown in it.

    ``autocast`` (``torch.bfloat16``): forward and the loss run under CPU autocast to that dtype, and backward
    after it, as a training step of ``bf16-mixed`` runs them; the copies autocast makes (its cache of each
    weight's low-precision copy too) are storages like any other. ``loss_fn``: the loss of the logits and targets."""
    inputs, targets = batch
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    with LiveStorages() as live:
        # autocast ends with forward (its cache of weight copies is cleared then): what backward needs of
        # those copies autograd saved
        with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            logits = net(inputs)
            loss = loss_fn(logits, targets)
        del logits  # freed, as a training step frees it: the loss keeps what it needs
        held = live.peak = live.live
        loss.backward()
    return held, live.peak
