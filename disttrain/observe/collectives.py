"""The collectives a rank enters through ``torch.distributed``, recorded: the last one (kind, group, size, sequence
number, whether it is still waiting) for a hang's report, and the seconds spent blocked in them for the step's
``collectives`` phase.

torch's Flight Recorder records NCCL's collectives only; gloo has none, so the functions disttrain and FSDP2 call
(``dist.all_reduce``, ``dist.all_gather_single``, ...) are wrapped in ``torch.distributed``'s namespace while a
rank trains. Calls made from C++ (DDP's gradient all-reduce) do not pass through them.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

WRAPPED = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "reduce_scatter_single",
           "reduce_scatter_tensor", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
           "all_to_all_single", "all_to_all", "reduce", "gather", "scatter", "send", "recv")
"""The ``torch.distributed`` functions recorded."""


@dataclass
class Entered:
    """One collective call."""

    seq: int
    """Its number among this rank's recorded collectives (1 for the first)."""
    kind: str
    """The function called (``all_reduce``)."""
    group: Any
    """The process group (None: the default one)."""
    numel: int
    """Elements of its first tensor argument (0 when it has none)."""
    dtype: str
    """That tensor's dtype."""
    entered: float
    """``time.monotonic()`` when it was called."""
    done: bool = False
    """It returned (an asynchronous one: its ``wait()`` returned)."""

    def describe(self) -> dict[str, Any]:
        """A JSON-ready record, with the group's global ranks and the seconds since it was entered."""
        try:
            ranks = dist.get_process_group_ranks(self.group if self.group is not None else dist.group.WORLD)
        except (RuntimeError, ValueError, AttributeError):  # a group already destroyed
            ranks = None
        return {"seq": self.seq, "kind": self.kind, "group_ranks": ranks, "numel": self.numel, "dtype": self.dtype,
                "waiting": not self.done, "seconds_since_entered": round(time.monotonic() - self.entered, 3)}


class _TimedWork(dist.Work):
    """An asynchronous collective's handle whose ``wait()`` is timed and marks the call done."""

    def __init__(self, work: dist.Work, call: Entered, recorder: CollectiveRecorder) -> None:
        super().__init__()
        self._work, self._call, self._recorder = work, call, recorder

    def wait(self, timeout: Any = None) -> bool:  # noqa: D102 - dist.Work's
        started = time.perf_counter()
        try:
            return self._work.wait() if timeout is None else self._work.wait(timeout)
        finally:
            self._recorder.blocked_s += time.perf_counter() - started
            self._call.done = True

    def is_completed(self) -> bool:  # noqa: D102 - dist.Work's
        return self._work.is_completed()

    def get_future(self) -> Any:  # noqa: D102 - dist.Work's
        future = self._work.get_future()
        future.add_done_callback(lambda _: setattr(self._call, "done", True))  # a comm hook's: never waited on
        return future

    def result(self) -> Any:  # noqa: D102 - dist.Work's
        return self._work.result()


class CollectiveRecorder:
    """Wraps ``WRAPPED`` while installed; ``last`` is the newest call, ``blocked_s`` the seconds spent blocked."""

    def __init__(self) -> None:
        self.seq = 0
        """Collectives recorded so far."""
        self.last: Entered | None = None
        """The newest collective entered (by the training thread)."""
        self.blocked_s = 0.0
        """Seconds spent inside blocking calls and in the ``wait()`` of asynchronous ones."""
        self._originals: dict[str, Any] = {}
        self.owner = threading.get_ident()
        """The training thread: its calls are recorded."""

    def install(self) -> None:
        """Wrap the functions (once) for the calling thread's calls."""
        if self._originals:
            return
        self.owner = threading.get_ident()
        for name in WRAPPED:
            original = getattr(dist, name, None)
            if original is not None:
                self._originals[name] = original
                setattr(dist, name, self._wrap(name, original))

    def uninstall(self) -> None:
        """Put torch's functions back."""
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals = {}

    def _wrap(self, kind: str, original: Any) -> Any:
        @functools.wraps(original)
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != self.owner:  # a helper thread's (an async checkpoint's) calls
                return original(*args, **kwargs)
            tensor = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
            self.seq += 1
            group = kwargs.get("group") or next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            call = Entered(self.seq, kind, group, tensor.numel() if tensor is not None else 0,
                           str(tensor.dtype).removeprefix("torch.") if tensor is not None else "", time.monotonic())
            self.last = call
            started = time.perf_counter()
            result = original(*args, **kwargs)
            if isinstance(result, dist.Work):
                return _TimedWork(result, call, self)
            self.blocked_s += time.perf_counter() - started
            call.done = True
            return result

        return recorded


RECORDER = CollectiveRecorder()
"""This process's recorder (the wrapped functions are process-wide)."""
