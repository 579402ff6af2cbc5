"""Hangs explained: each rank writes its Python stack (every thread) and the collective it last entered, and the
job reads them into one summary: which ranks wait in which collective, and which rank has not reached it.

A rank writes its report from its watchdog thread (the training thread may be blocked inside a collective, where
it runs no Python) when the watchdog finds a hang, or when the job asks through the store (``DUMP_KEY``), as it
does on SIGUSR2.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

from disttrain.observe.collectives import RECORDER

DUMP_KEY = "disttrain/dump"
"""Store key the job (or a rank that found a hang) sets to ask every rank for its report; its value numbers the
request, so a rank answers each request once."""
BACKWARD_FRAME = "_engine_run_backward"
"""The innermost Python function of a training thread blocked in autograd's C++ backward."""
REPORTS_FOLDER = "hang"
"""In the run's ``logs/`` folder: ``rank<R>.json`` per rank that answered."""


def write_report(folder: Path, rank: int, reason: str) -> Path:
    """Write this rank's stacks (all threads, innermost frame last) and last collective to ``folder/rank<R>.json``
    (whole or not at all)."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    frames = sys._current_frames()
    stacks = {f"{names.get(ident, 'thread')} ({ident})": "".join(traceback.format_stack(frame))
              for ident, frame in frames.items()}
    training = frames.get(RECORDER.owner)
    last = RECORDER.last
    report = {"rank": rank, "host": socket.gethostname(), "pid": os.getpid(), "reason": reason,
              "collectives_entered": RECORDER.seq, "collective": last.describe() if last else None,
              "training_thread_in": training.f_code.co_name if training is not None else None, "stacks": stacks}
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{rank}.json"
    partial = path.with_suffix(".json.partial")
    partial.write_text(json.dumps(report, indent=1))
    partial.replace(path)
    return path


def read_reports(folder: Path) -> dict[int, dict[str, Any]]:
    """The ranks' reports in ``folder`` by rank (a report that cannot be read is left out)."""
    reports = {}
    for path in sorted(folder.glob("rank*.json")):
        try:
            report = json.loads(path.read_text())
            reports[int(report["rank"])] = report
        except (OSError, ValueError, KeyError):
            continue
    return reports


def _collective(call: dict[str, Any]) -> str:
    group = call["group_ranks"]
    ranks = f"ranks {group}" if group is not None else "a group"
    size = f", {call['numel']:,} {call['dtype']} elements" if call["numel"] else ""
    return f"{call['kind']} #{call['seq']} ({ranks}{size})"


def _silent(rank: int) -> str:
    return f"rank {rank} (no report: stopped, frozen or gone)"


def summary(folder: Path, world_size: int) -> list[str]:
    """The job's lines about a hang: per collective, the ranks waiting in it and how long; the ranks that have not
    reached it (behind in the sequence, or silent: stopped, frozen or gone); where each report is."""
    reports = read_reports(folder)
    if not reports:
        return []
    lines = [f"hang report: stacks of ranks {sorted(reports)} in {folder}"]
    waiting: dict[int, list[int]] = {}
    in_backward: list[int] = []
    for rank, report in sorted(reports.items()):
        call = report.get("collective")
        if call and call["waiting"]:
            waiting.setdefault(call["seq"], []).append(rank)
        elif report.get("training_thread_in") == BACKWARD_FRAME:
            in_backward.append(rank)
        elif call:
            lines.append(f"  rank {rank} is in no recorded collective; the last it entered was {_collective(call)}")
        else:
            lines.append(f"  rank {rank} entered no collective yet")
    if in_backward:  # DDP's gradient all-reduce is made from C++, where no Python function is called
        silent = [rank for rank in range(world_size) if rank not in reports]
        lines.append(f"  ranks {in_backward} wait inside the backward (DDP's gradient all-reduce, made outside "
                     f"Python: not recorded); " + (f"not reached by {', '.join(map(_silent, silent))}" if silent
                                                   else "every rank answered"))
    for seq, ranks in sorted(waiting.items()):
        call = reports[ranks[0]]["collective"]
        longest = max(reports[rank]["collective"]["seconds_since_entered"] for rank in ranks)
        behind = sorted(rank for rank, report in reports.items() if report["collectives_entered"] < seq)
        silent = sorted(set(call["group_ranks"] or range(world_size)) - set(reports))
        missing = [f"rank {rank} (its last was #{reports[rank]['collectives_entered']})" for rank in behind]
        missing += [_silent(rank) for rank in silent]
        lines.append(f"  ranks {ranks} wait in {_collective(call)} for up to {longest:.0f} s; not reached by "
                     + (", ".join(missing) if missing else "no rank that answered (a mismatch of collectives?)"))
    return lines
