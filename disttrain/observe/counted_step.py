"""A step's memory on a CPU, through the framework's tensor-byte counter
(``disttrain.observe.tensor_bytes.LiveStorages``): every storage alive at the step's start and every one its
operators make, from creation to release, with the module and the phase that made it.

What is alive at the start is every tensor Python reaches then (``gc``): the parameters' local shards, gradients,
optimiser state, the batch, and storages FSDP2 keeps at no size between uses, which the counter then follows as they
are filled and emptied again; a tensor only C++ holds (DDP's gradient buckets) is not seen until an operator makes
one. The module comes from torch's ``ModuleTracker`` (forward hooks, and gradient hooks for backward); backward is
the autograd engine running (a pipeline's schedule runs it inside ``training_step``), and otherwise the phase is
the one Lightning's hooks last entered (an optimiser's own ``step`` will not do: Lightning runs forward and
backward inside it, as its closure).
"""

from __future__ import annotations

import gc
import time
import warnings
from typing import Any

import torch
from torch.utils.module_tracker import ModuleTracker

from disttrain.observe.memory_timeline import START, Holder, MemoryEvent, StepTimeline
from disttrain.observe.tensor_bytes import LiveStorages, plain_tensors

COUNTED_BY = "the tensor-byte counter (disttrain.observe.tensor_bytes.LiveStorages)"
"""``StepTimeline.counted_by`` of a CPU step."""

HELD_BEFORE = "held before the step"
"""What a storage alive at the start is, when it is no parameter, gradient, optimiser state or batch."""


class _NamedOperators(LiveStorages):
    """The counter, remembering the operator it is counting the outputs of."""

    operator = ""
    """The operator running now (empty outside operators)."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.operator = str(func)
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self.operator = ""


class CountedStep:
    """Record one step: ``start`` with what the step begins with, ``stage`` as Lightning's hooks pass, ``stop``."""

    def __init__(self, step: int, rank: int) -> None:
        self.timeline = StepTimeline(step, rank, COUNTED_BY)
        """The record (complete after ``stop``)."""
        self.counter = _NamedOperators(follow_resizes=True, listener=self._heard)
        """The counter; its ``peak`` is the step's, counted independently of the timeline's list."""
        self._holder_of: dict[int, int] = {}
        self._origin: tuple[str, str] | None = None
        self._stage = "forward"
        self._tracker = ModuleTracker()
        self._began = 0.0
        self.peak = 0
        """The counter's peak over the step, once stopped: the most bytes alive at once, kept by the counter as
        it counts, apart from the timeline's list of changes."""

    def start(self, labelled: list[tuple[str, str, torch.Tensor]]) -> None:
        """Count what is alive now and begin recording. ``labelled``: ``(what, name, tensor)`` of the storages
        whose origin is known (``parameter``, ``net.head.weight``, ...), the first label of a storage winning;
        every other tensor Python reaches is ``HELD_BEFORE``."""
        for what, name, tensor in labelled:
            self._count_held(tensor, what, name)
        for tensor in _reachable_tensors():
            self._count_held(tensor, HELD_BEFORE, "")
        with self.counter.lock:  # no release on another thread between the start's sizes and the first event
            self._origin = None
            self.timeline.start = self._start_sizes()
            self.timeline.events.clear()
            self._began = time.perf_counter()
        self._tracker.__enter__()
        self.counter.__enter__()

    def stage(self, phase: str) -> None:
        """The step has entered ``phase`` (``forward``, ``backward``, ``optimiser``), by Lightning's hooks; the
        autograd engine says so itself where no hook runs (a pipeline's schedule)."""
        self._stage = phase

    def mark(self, moment: str) -> None:
        """Name this point of the step ``moment``."""
        self.timeline.moments[moment] = len(self.timeline.events)

    def stop(self) -> StepTimeline:
        """End the recording; the timeline (``peak`` holds the counter's own)."""
        with self.counter.lock:  # what the step leaves alive is released later, outside the record
            self.counter.listener = None
        self.counter.__exit__(None, None, None)
        self._tracker.__exit__(None, None, None)
        self.peak = self.counter.peak
        return self.timeline

    def _count_held(self, tensor: torch.Tensor, what: str, name: str) -> None:
        for plain in plain_tensors([tensor]):
            if not isinstance(plain, torch.Tensor) or plain.is_meta:
                continue
            try:
                storage = plain.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a layout without one storage (sparse, nested)
                continue
            self._origin = (what, name)
            self.counter.count(storage, plain)

    def _start_sizes(self) -> dict[int, int]:
        sizes: dict[int, int] = {}
        for event in self.timeline.events:
            sizes[event.holder] = sizes.get(event.holder, 0) + event.delta
        return sizes

    def _phase(self) -> str:
        if self._origin is not None:
            return START
        return "backward" if self._tracker.is_bw else self._stage

    def _heard(self, key: int, delta: int, counted_by: Any) -> None:
        """The counter changed by ``delta`` bytes of storage ``key`` (``counted_by``: the tensor, when new)."""
        phase = self._phase()
        if counted_by is not None:
            self._holder_of[key] = len(self.timeline.holders)
            self.timeline.holders.append(self._holder(delta, counted_by, phase))
        number = self._holder_of.get(key)
        if number is None:  # a storage counted before the listener was set: none is
            return
        self.timeline.events.append(MemoryEvent(time.perf_counter() - self._began, delta, number, phase))

    def _holder(self, size: int, counted_by: Any, phase: str) -> Holder:
        tensor = counted_by if isinstance(counted_by, torch.Tensor) else None
        shape, dtype = (list(tensor.shape), str(tensor.dtype).removeprefix("torch.")) if tensor is not None \
            else ([], "")
        if tensor is not None and size and tensor.numel() * tensor.element_size() != size:
            shape = []  # a view of part of its storage: its shape would not be the storage's
        if self._origin is not None:
            what, name = self._origin
            return Holder(size, shape, dtype, name, phase, what)
        return Holder(size, shape, dtype, self._module(), phase, self.counter.operator)

    def _module(self) -> str:
        """The innermost module running (``GPT.blocks.0.attn``: the outermost one that ran by its class, then the
        path below it), empty outside modules."""
        try:
            parents = [name for name in list(self._tracker.parents) if name != "Global"]
        except RuntimeError:  # changed as it was read: a release on another thread, which makes nothing
            return ""
        if not parents:
            return ""
        inner = max(parents, key=lambda name: (name.count("."), len(name)))
        return inner


def _reachable_tensors() -> list[torch.Tensor]:
    """Every tensor object Python holds now (including storages kept at no size, which FSDP2 fills later)."""
    found = []
    with warnings.catch_warnings():  # asking a deprecated module attribute its class warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor):
                    found.append(obj)
            except ReferenceError:  # a dead weak proxy
                continue
    return found
