"""When the command started: the clock that time to first step and end-to-end throughput count from.

The job process records its own start in ``DISTTRAIN_COMMAND_START`` before it starts worker ranks, so a
worker's figures count from the user's command, not from the worker's own (later) start.
"""

from __future__ import annotations

import os
import time

COMMAND_START_VARIABLE = "DISTTRAIN_COMMAND_START"
_IMPORTED = time.time()
_runs_recorded = 0


def process_start_time() -> float:
    """Wall-clock time (seconds since the epoch) this process started: from /proc on Linux, elsewhere when
    disttrain was first imported."""
    try:
        with open("/proc/self/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as handle:
            uptime = float(handle.read().split()[0])
        age = uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat: start time after boot
        return time.time() - age
    except (OSError, ValueError, IndexError):
        return _IMPORTED


def command_start_time() -> float:
    """When the user's command started: the job process's start as it recorded it, else this process's."""
    recorded = os.environ.get(COMMAND_START_VARIABLE)
    return float(recorded) if recorded else process_start_time()


def record_command_start() -> None:
    """Called by the job process as a run begins, before it starts ranks (a launcher's ranks keep their own
    start). The process's first run counts from the process's start (its imports are the run's); a later
    run of the same process (the next job of a sweep) from this call."""
    global _runs_recorded
    os.environ[COMMAND_START_VARIABLE] = repr(process_start_time() if _runs_recorded == 0 else time.time())
    _runs_recorded += 1
