"""The framework's tensor-byte counter: the bytes of the tensor storages alive, counted from their creation to their
release. The planner measures a model's activations with it (``disttrain.plan.measure``), ``mode=dryrun`` a rank's
steps, and ``callbacks=memory`` one step of a training run."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


def plain_tensors(tree: Any) -> list[Any]:
    """The leaves of ``tree``, with each tensor subclass that wraps others (a DTensor) replaced by the tensors it
    wraps: a mode sees a DTensor operator whole, and a DTensor's own storage has the size of the whole tensor,
    not of the shard it holds."""
    leaves = []
    for leaf in tree_leaves(tree):
        if is_traceable_wrapper_subclass(leaf):
            names, _ = leaf.__tensor_flatten__()
            leaves += plain_tensors([getattr(leaf, name) for name in names])
        else:
            leaves.append(leaf)
    return leaves


def _is_counted(value: Any, meta: bool) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta == meta


class LiveStorages(TorchDispatchMode):
    """Bytes of the tensor storages that operators create inside this mode and that are still alive, and their
    peak. Each storage is counted once (views share it; what an operator returns in an input's storage is not
    new) and leaves the count when its last reference goes, on
    whatever thread that happens: a storage a gloo collective wrote into is released on gloo's worker thread,
    which torch's profiler memory events never see (they showed such buffers as held for good).

    ``meta``: count meta tensors instead (the planner's pass: their storages have sizes and lifetimes, no data).
    ``follow_resizes``: also follow storages that change size in place, at every operator: FSDP2 frees a unit's
    gathered parameters and its all-gather buffers by resizing their storages to nothing and allocates them again
    the same way, which no operator shows (without it a storage keeps the size it was counted at).
    ``listener``: called at every change of the count with the storage's key, the change in bytes and, when the
    storage is first counted, the tensor it was counted by (the storage itself where none was given; None at
    a later change); under the count's lock, so the changes reach it in the order they were made, from whichever
    thread made them."""

    def __init__(self, meta: bool = False, follow_resizes: bool = False,
                 listener: Callable[[int, int, Any], None] | None = None) -> None:
        super().__init__()
        self.meta = meta
        self.follow_resizes = follow_resizes
        self.listener = listener
        """Told of every change of ``live`` (see the class)."""
        # a release may come from another thread (gloo's) or from inside a change (a storage freed as a local
        # reference to it goes), so the lock is re-entrant
        self.lock = threading.RLock()
        """Held while the count changes (and its listener hears of it): hold it to read the count and what the
        listener has heard as one."""
        self.live = 0
        """Bytes alive now."""
        self.peak = 0
        """The most bytes alive at once."""
        self._refs: dict[int, weakref.ref] = {}
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.follow_resizes:
            self.resync()
        out = func(*args, **(kwargs or {}))
        # views and in-place results share an input's storage (a weight's transpose is the weight's memory)
        inputs = {t.untyped_storage()._cdata for t in plain_tensors((args, kwargs)) if _is_counted(t, self.meta)}
        for leaf in plain_tensors(out):
            if _is_counted(leaf, self.meta) and leaf.untyped_storage()._cdata not in inputs:
                self.count(leaf.untyped_storage(), leaf)
        if self.follow_resizes:
            self.resync()
        return out

    def count(self, storage: torch.UntypedStorage, tensor: torch.Tensor | None = None) -> None:
        """Count ``storage`` (made outside the mode) until its release, as if an operator inside had made it;
        ``tensor``: one that views it, for the listener."""
        with self.lock:
            key = storage._cdata
            if key in self._refs or (storage.nbytes() == 0 and not self.follow_resizes):
                return
            self._sizes[key] = storage.nbytes()

            def release(_: Any, key: int = key) -> None:
                with self.lock:
                    self._refs.pop(key, None)
                    self._change(key, -self._sizes.pop(key, 0), None)

            # torch keeps a storage's Python object as long as its C++ storage lives, so the weak reference dies
            # exactly when the memory is freed
            self._refs[key] = weakref.ref(storage, release)
            self._change(key, self._sizes[key], tensor if tensor is not None else storage)

    def resync(self) -> None:
        """Take the current size of every counted storage (``follow_resizes``)."""
        with self.lock:
            for key, ref in list(self._refs.items()):
                storage = ref()
                if storage is None or key not in self._sizes:
                    continue
                size = storage.nbytes()
                if size != self._sizes[key]:
                    delta, self._sizes[key] = size - self._sizes[key], size
                    self._change(key, delta, None)

    def _change(self, key: int, delta: int, counted_by: Any) -> None:
        """``live`` moves by ``delta`` bytes of storage ``key`` (under the lock)."""
        self.live += delta
        self.peak = max(self.peak, self.live)
        if self.listener is not None:
            self.listener(key, delta, counted_by)
