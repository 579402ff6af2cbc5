"""A step's memory on a GPU, through torch's CUDA memory history (``torch.cuda.memory._record_memory_history``):
the caching allocator's own record of each block it hands out and takes back, with the Python frames that asked.

Untested here (the machines this was written on have no GPU). What was allocated before the step is one holder
(``held before the step``, ``torch.cuda.memory_allocated`` then); a block it frees during the step comes off that
holder. Phases are not told apart on a GPU: the allocator's record carries no phase.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from disttrain.observe.memory_timeline import START, Holder, MemoryEvent, StepTimeline

COUNTED_BY = "CUDA memory history (torch.cuda.memory._record_memory_history)"
"""``StepTimeline.counted_by`` of a GPU step."""

MAX_ENTRIES = 1_000_000
"""Allocator events kept: more than a step of a large model makes; older ones drop out first."""


class CudaStep:
    """Record one step on ``device``: ``start``, ``mark`` at named moments, ``stop``."""

    def __init__(self, step: int, rank: int, device: torch.device) -> None:
        self.device = device
        self.timeline = StepTimeline(step, rank, COUNTED_BY)
        """The record (complete after ``stop``)."""
        self.peak = 0
        """The allocator's peak of the run so far, once stopped (``torch.cuda.max_memory_allocated``, which
        results.json reports: it is not reset here, so that results.json's stays the run's)."""
        self._marks: dict[str, float] = {}
        self._began_us = 0.0

    def start(self) -> None:
        """Begin recording."""
        torch.cuda.synchronize(self.device)
        self.timeline.holders = [Holder(torch.cuda.memory_allocated(self.device), [], "", "", START,
                                        "held before the step")]
        self.timeline.start = {0: self.timeline.holders[0].bytes}
        # Python frames only: symbolising C++ stacks for every block makes the snapshot slow
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=MAX_ENTRIES, device=self.device)
        self._began_us = time.time() * 1e6

    def stage(self, phase: str) -> None:
        """Phases are not told apart on a GPU (see the module)."""

    def mark(self, moment: str) -> None:
        """Name this point of the step ``moment`` (once the device has caught up with the host)."""
        torch.cuda.synchronize(self.device)
        self._marks[moment] = time.time() * 1e6

    def stop(self) -> StepTimeline:
        """End the recording; the timeline."""
        torch.cuda.synchronize(self.device)
        self.peak = torch.cuda.max_memory_allocated(self.device)
        snapshot = torch.cuda.memory._snapshot(self.device)
        torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
        add_trace(self.timeline, snapshot["device_traces"][self.device.index or 0], self._began_us, self._marks)
        return self.timeline


def add_trace(timeline: StepTimeline, trace: list[dict[str, Any]], began_us: float, marks: dict[str, float]) -> None:
    """Add a device's allocator trace (``torch.cuda.memory._snapshot()["device_traces"][device]``: entries with
    ``action``, ``addr``, ``size``, ``time_us`` and ``frames``) to ``timeline``, whose holder 0 is what was allocated
    when recording began (``began_us``, microseconds since the epoch, as ``time_us``); ``marks``: named moments ->
    their time in the same microseconds. A block counts from its ``alloc`` to its ``free_completed``, as the
    allocator's ``memory_allocated`` counts it; a freed block the trace never saw allocated comes off holder 0."""
    holder_at: dict[int, int] = {}
    for entry in trace:
        if entry["action"] == "alloc":
            holder_at[entry["addr"]] = len(timeline.holders)
            timeline.holders.append(Holder(entry["size"], [], "", _origin(entry.get("frames", [])), "", "allocation"))
            delta, holder = entry["size"], holder_at[entry["addr"]]
        elif entry["action"] == "free_completed":
            delta, holder = -entry["size"], holder_at.pop(entry["addr"], 0)
        else:  # segments mapped and unmapped, frees requested but waiting on a stream: nothing allocated changes
            continue
        timeline.events.append(MemoryEvent((entry.get("time_us", began_us) - began_us) / 1e6, delta, holder, ""))
    for moment, at_us in marks.items():
        timeline.moments[moment] = sum(1 for event in timeline.events if began_us + event.seconds * 1e6 <= at_us)


def _origin(frames: list[dict[str, Any]]) -> str:
    """The innermost Python frame outside torch that asked for the block (``file:line function``)."""
    for frame in frames:
        if "/torch/" not in frame.get("filename", ""):
            return f"{frame['filename']}:{frame.get('line', '?')} {frame.get('name', '')}"
    return ""
