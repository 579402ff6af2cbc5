"""Measured timeline of one pipelined training step (``parallel.pipeline.timeline=true``).

Each rank of the pipeline that holds global rank 0 times the compute actions of its stages (forward, full
backward, and the input- and weight-gradient halves of the zero-bubble schedules) per microbatch during one
schedule step after warm-up. After training rank 0 gathers the ranks' records, and writes them as
``plots/pipeline_timeline.json`` and, where pictures are drawn, ``plots/pipeline_timeline.png``.

Times are read from the wall clock (``time.time``): on one machine every process reads the same clock, so
the ranks' records line up exactly; across machines they line up as well as the machines' clocks agree.
On a GPU the recorded step synchronises the device around each action, so that a box is the action's
execution, not the launch of its kernels; that step alone runs without overlap of compute and transfers.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from disttrain.report.plots import pyplot, save

JSON_FILE = "pipeline_timeline.json"
PNG_FILE = "pipeline_timeline.png"
ACTION_NAMES = {"F": "forward", "B": "backward (full)", "I": "backward, input gradient",
                "W": "backward, weight gradient"}
"""Recorded action types: torch's computation types of a pipeline schedule."""
_WRAPPED = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class ActionRecorder:
    """Times every compute action of ``stages`` (torch ``PipelineStage`` objects) inside ``recording()``.

    The stages' methods are wrapped for the recorded step only and restored after it, so the other steps
    run torch's code untouched.
    """

    def __init__(self, stages: list[Any], **about: Any) -> None:
        self.stages = stages
        self.about = about
        """What the records describe (schedule, microbatches, ...), copied into the timeline."""
        self.actions: list[dict[str, Any]] = []
        """The last recorded step's actions: type, stage, microbatch, start_s and end_s (absolute seconds)."""
        self.step: tuple[float, float] | None = None
        """Start and end of the last recorded schedule step."""
        self._device = next((s.device for s in stages if getattr(s, "device", None) is not None), None)

    def clock(self) -> float:
        """Seconds on the wall clock, after the device's queued work has finished (GPU)."""
        if self._device is not None and self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        return time.time()

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Record the actions run inside the block, replacing the previous record."""
        self.actions = []
        for stage in self.stages:
            self._wrap(stage)
        start = self.clock()
        try:
            yield
        finally:
            end = self.clock()
            for stage in self.stages:
                for name in _WRAPPED:
                    stage.__dict__.pop(name, None)  # back to the class's method
        self.step = (start, end)

    def _timed(self, kind: str, stage: Any, chunk: int, method: Any, *args: Any, **kwargs: Any) -> Any:
        start = self.clock()
        out = method(chunk, *args, **kwargs)
        self.actions.append({"type": kind, "stage": stage.stage_index, "microbatch": chunk, "start_s": start,
                             "end_s": self.clock()})
        return out

    def _wrap(self, stage: Any) -> None:
        forward, backward, weight = (getattr(stage, name) for name in _WRAPPED)

        def forward_one_chunk(chunk: int, *args: Any, **kwargs: Any) -> Any:
            return self._timed("F", stage, chunk, forward, *args, **kwargs)

        def backward_one_chunk(chunk: int, loss: Any = None, full_backward: bool = True,
                               last_backward: bool = False) -> Any:
            return self._timed("B" if full_backward else "I", stage, chunk, backward, loss=loss,
                               full_backward=full_backward, last_backward=last_backward)

        def backward_weight_one_chunk(chunk: int, *args: Any, **kwargs: Any) -> Any:
            return self._timed("W", stage, chunk, weight, *args, **kwargs)

        stage.forward_one_chunk = forward_one_chunk
        stage.backward_one_chunk = backward_one_chunk
        stage.backward_weight_one_chunk = backward_weight_one_chunk

    def local_record(self) -> dict[str, Any] | None:
        """This rank's part of the timeline (absolute times), or None when no step was recorded."""
        if self.step is None:
            return None
        return {"global_rank": dist.get_rank() if dist.is_initialized() else 0, "host": socket.gethostname(),
                "stages": sorted(stage.stage_index for stage in self.stages), "step_start_s": self.step[0],
                "step_end_s": self.step[1], "actions": self.actions}


def records_on(pp_group: Any) -> bool:
    """This rank belongs to the pipeline whose timeline is written (the one of global rank 0)."""
    return 0 in dist.get_process_group_ranks(pp_group)


def gather_timeline(recorder: ActionRecorder, pp_group: Any) -> dict[str, Any] | None:
    """Gather the pipeline ranks' records on global rank 0 (a collective of ``pp_group``: call it on every
    member, after training); the timeline there, None elsewhere and when no step was recorded."""
    records: list[Any] | None = [None] * dist.get_world_size(pp_group) if dist.get_rank() == 0 else None
    dist.gather_object(recorder.local_record(), records, dst=0, group=pp_group)
    if records is None or any(record is None for record in records):
        return None
    return build_timeline(records, recorder.about)


def build_timeline(records: list[dict[str, Any]], about: dict[str, Any]) -> dict[str, Any]:
    """The timeline of one step from each pipeline rank's record, times in seconds from the first rank's
    step start. A rank's idle fraction is the share of the step (first start to last end over the ranks)
    that it spent outside its compute actions: waiting for activations and gradients, transfers, the loss;
    the bubble fraction is their mean."""
    origin = min(r["step_start_s"] for r in records)
    step = max(r["step_end_s"] for r in records) - origin
    ranks = []
    for pp_rank, record in enumerate(records):
        actions = [{**a, "start_s": round(a["start_s"] - origin, 6), "end_s": round(a["end_s"] - origin, 6)}
                   for a in record["actions"]]
        busy = sum(a["end_s"] - a["start_s"] for a in actions)
        ranks.append({**record, "pp_rank": pp_rank, "step_start_s": round(record["step_start_s"] - origin, 6),
                      "step_end_s": round(record["step_end_s"] - origin, 6), "busy_s": round(busy, 6),
                      "idle_fraction": round(1 - busy / step, 4) if step > 0 else 0.0, "actions": actions})
    return {**about, "clock": "seconds from the first rank's step start (wall clock)", "step_s": round(step, 6),
            "bubble_fraction": round(sum(r["idle_fraction"] for r in ranks) / len(ranks), 4), "ranks": ranks}


def write_timeline(timeline: dict[str, Any], folder: Path, draw: bool) -> list[Path]:
    """``folder/pipeline_timeline.json`` always, and its picture when ``draw`` and matplotlib is installed."""
    folder.mkdir(parents=True, exist_ok=True)
    written = [folder / JSON_FILE]
    written[0].write_text(json.dumps(timeline, indent=1) + "\n")
    if draw:
        title = f"{timeline.get('schedule', 'pipeline')}, {timeline.get('microbatches', '?')} microbatches, " \
                f"optimiser step {timeline.get('step', '?')}"
        png = draw_pipeline_timeline([(title, timeline)], folder / PNG_FILE)
        written += [png] if png is not None else []
    return written


TIMELINE_COLOURS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}
"""Colour of each pipeline action type (forward, full backward, input-gradient and weight-gradient halves)."""
_IDLE = "#eeeeee"


def draw_pipeline_timeline(panels: list[tuple[str, dict[str, Any]]], path: Path) -> Path | None:
    """One panel per ``(title, timeline)``, one row per pipeline rank: a box per compute action, coloured by
    its type and labelled with its microbatch (``stage.microbatch`` where a rank holds several stages), over
    a grey step; each title ends with the step time and the measured bubble fraction.

    A timeline is a dict as in ``pipeline_timeline.json`` (see disttrain.parallel.pipeline.timeline):
    ``step_s``, ``bubble_fraction`` and ``ranks``, each with ``actions`` (type, stage, microbatch, start_s,
    end_s in seconds from the step start) and optionally ``stages``."""
    plt = pyplot()
    if plt is None:
        return None
    from matplotlib.patches import Patch

    rows = sum(len(timeline["ranks"]) for _, timeline in panels)
    figure, axes = plt.subplots(len(panels), 1, figsize=(14, 1.4 + 0.55 * rows), squeeze=False)
    for ax, (title, timeline) in zip(axes[:, 0], panels, strict=True):
        step = timeline["step_s"]
        several = any(len(rank.get("stages") or ()) > 1 for rank in timeline["ranks"])
        for row, rank in enumerate(timeline["ranks"]):
            ax.broken_barh([(0, step)], (row - 0.4, 0.8), facecolors=_IDLE)
            for action in rank["actions"]:
                start, end = action["start_s"], action["end_s"]
                ax.broken_barh([(start, end - start)], (row - 0.4, 0.8), facecolors=TIMELINE_COLOURS[action["type"]],
                               edgecolor="white", linewidth=0.5)
                if end - start > step / 80:  # a label only where it fits
                    label = f"{action['stage']}.{action['microbatch']}" if several else str(action["microbatch"])
                    ax.text((start + end) / 2, row, label, ha="center", va="center", fontsize=6, color="white")
        labels = "stage.microbatch" if several else "microbatch"
        ax.set_title(f"{title}: step {step * 1000:.1f} ms, bubble {timeline['bubble_fraction']:.2f} "
                     f"(labels: {labels})", fontsize=9)
        ax.set_yticks(range(len(timeline["ranks"])), [f"rank {r}" for r in range(len(timeline["ranks"]))])
        ax.invert_yaxis()
        ax.set_xlim(0, step)
    axes[-1, 0].set_xlabel("seconds from the step start")
    shown = {a["type"] for _, timeline in panels for rank in timeline["ranks"] for a in rank["actions"]}
    handles = [Patch(color=c, label=ACTION_NAMES[k]) for k, c in TIMELINE_COLOURS.items() if k in shown]
    figure.legend(handles=[*handles, Patch(color=_IDLE, label="idle")], loc="upper right", ncol=5, fontsize=8)
    figure.tight_layout(rect=(0, 0, 1, 1 - 0.3 / (1.4 + 0.55 * rows)))
    return save(figure, plt, path)
