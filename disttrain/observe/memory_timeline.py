"""One recorded step's memory as a list of changes: what was alive at its start, then every allocation, release
and resize in order, each with the tensor it belongs to; the bytes alive after each change, the peak, and what
held the memory at the peak follow from the list alone."""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any

START = "start"
"""The phase of what was alive when the step began."""


@dataclass
class Holder:
    """A tensor's storage: its size when counted and where it came from."""

    bytes: int
    """Bytes when first counted (a storage resized later changes by its events)."""
    shape: list[int]
    """Shape of the tensor it was counted by (empty where only the storage was seen, or the tensor viewed a part
    of it)."""
    dtype: str
    """Its dtype (empty where only the storage was seen)."""
    module: str
    """The innermost module running when it was made (``net.blocks.0.attn``; a parameter's own name for model
    state; empty outside every module)."""
    phase: str
    """When it was made: ``start`` (alive before the step), ``forward``, ``backward`` or ``optimiser``."""
    made_by: str
    """What made it: the operator (``aten.mm.default``), or what it is for storages alive at the start
    (``parameter``, ``gradient``, ``optimiser state``, ``batch``, ``held before the step``)."""


@dataclass
class MemoryEvent:
    """One change of the bytes alive."""

    seconds: float
    """Since the step began."""
    delta: int
    """Bytes added (negative: freed)."""
    holder: int
    """The storage's number in ``StepTimeline.holders``."""
    phase: str
    """The phase running when it happened (a release on another thread: the phase the step was in)."""


@dataclass
class StepTimeline:
    """A step's memory, change by change."""

    step: int
    """Optimiser steps done before it (0: the first)."""
    rank: int
    """The rank that recorded it."""
    counted_by: str
    """What counted the bytes (the tensor-byte counter, or CUDA's memory history)."""
    holders: list[Holder] = field(default_factory=list)
    """Every storage seen, by number."""
    start: dict[int, int] = field(default_factory=dict)
    """Holders alive when the step began -> their bytes then."""
    events: list[MemoryEvent] = field(default_factory=list)
    """The changes during the step, in order."""
    moments: dict[str, int] = field(default_factory=dict)
    """Named moments of the step (``after_forward``, ``after_backward``, ``after_step``) -> the number of events
    before them."""

    def live(self) -> list[int]:
        """Bytes alive at the start and after each event."""
        return list(itertools.accumulate((event.delta for event in self.events), initial=sum(self.start.values())))

    def peak(self) -> tuple[int, int]:
        """The most bytes alive at once and after how many events (the first time, where it recurs)."""
        live = self.live()
        index = max(range(len(live)), key=live.__getitem__)
        return live[index], index

    def held_after(self, events: int) -> dict[int, int]:
        """Holders alive after the first ``events`` events -> their bytes then."""
        held = dict(self.start)
        for event in self.events[:events]:
            held[event.holder] = held.get(event.holder, 0) + event.delta
        return {holder: size for holder, size in held.items() if size > 0}

    def largest_at_peak(self, count: int) -> list[tuple[Holder, int]]:
        """The ``count`` largest holders at the peak, largest first, with their bytes then."""
        held = self.held_after(self.peak()[1])
        ranked = sorted(held.items(), key=lambda item: (-item[1], item[0]))[:count]
        return [(self.holders[number], size) for number, size in ranked]

    def phase_spans(self) -> list[tuple[str, int, int]]:
        """The phases in order as ``(phase, first event, last event + 1)``, one span per run of events."""
        spans: list[tuple[str, int, int]] = []
        for index, event in enumerate(self.events):
            if spans and spans[-1][0] == event.phase:
                spans[-1] = (event.phase, spans[-1][1], index + 1)
            else:
                spans.append((event.phase, index, index + 1))
        return spans

    def as_json(self, largest: int, planned: dict[str, float] | None) -> dict[str, Any]:
        """``logs/memory_step.json``: the peak and its ``largest`` holders, the moments beside the plan's
        (``planned``: the plan's bytes at its moments, None without a plan), the phases and the timeline."""
        peak, at = self.peak()
        live = self.live()
        return {
            "step": self.step, "rank": self.rank, "counted_by": self.counted_by,
            "peak_bytes": peak, "peak_after_events": at, "events": len(self.events),
            "peak_phase": self.events[at - 1].phase if at else START,
            "start_bytes": live[0], "end_bytes": live[-1],
            "largest_at_peak": [{**asdict(holder), "bytes_at_peak": size}
                                for holder, size in self.largest_at_peak(largest)],
            "measured_moments_bytes": {name: live[index] for name, index in self.moments.items()},
            "moments_after_events": dict(self.moments),
            "planned_moments_bytes": planned,
            "phases": [{"phase": phase, "first_event": first, "end_event": end}
                       for phase, first, end in self.phase_spans()],
            "timeline": {"seconds": [round(event.seconds, 6) for event in self.events],
                         "delta_bytes": [event.delta for event in self.events],
                         "holder": [event.holder for event in self.events],
                         "live_bytes": live[1:]},
            "holders": [asdict(holder) for holder in self.holders],
        }
