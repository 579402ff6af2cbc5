"""What a rank's activations measure on a CPU, to hold the planner's predictions against."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _is_counted(value: Any, meta: bool) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta == meta


class LiveStorages(TorchDispatchMode):
    """Bytes of the tensor storages that operators create inside this mode and that are still alive, and their
    peak. Each storage is counted once (views share it; what an operator returns in an input's storage is not
    new) and leaves the count when its last reference goes, on
    whatever thread that happens: a storage a gloo collective wrote into is released on gloo's worker thread,
    which torch's profiler memory events never see (they showed such buffers as held for good).

    ``meta``: count meta tensors instead (the planner's pass: their storages have sizes and lifetimes, no data)."""

    def __init__(self, meta: bool = False) -> None:
        super().__init__()
        self.meta = meta
        self.live = 0
        """Bytes alive now."""
        self.peak = 0
        """The most bytes alive at once."""
        self._refs: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # views and in-place results share an input's storage (a weight's transpose is the weight's memory)
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if _is_counted(t, self.meta)}
        for leaf in tree_leaves(out):
            if _is_counted(leaf, self.meta) and leaf.untyped_storage()._cdata not in inputs:
                self.count(leaf.untyped_storage())
        return out

    def count(self, storage: torch.UntypedStorage) -> None:
        """Count ``storage`` (made outside the mode) until its release, as if an operator inside had made it."""
        key = storage._cdata
        if key in self._refs or storage.nbytes() == 0:
            return
        size = storage.nbytes()

        def release(_: Any, key: int = key, size: int = size) -> None:
            self._refs.pop(key, None)
            self.live -= size

        # torch keeps a storage's Python object as long as its C++ storage lives, so the weak reference dies
        # exactly when the memory is freed
        self._refs[key] = weakref.ref(storage, release)
        self.live += size
        self.peak = max(self.peak, self.live)


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
