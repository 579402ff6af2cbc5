"""Replica groups (``fault_tolerance.engine=torchft``): what the job tells each group's ranks, and the group's view
of a run validated for the whole job.

Each group is a ``torch.distributed`` world of its own (own store, own default process group, own mesh without the
replicate dimension); only the step's gradient mean, and the vote on committing it, cross groups. The job sets
``GROUP_VAR``/``GROUPS_VAR`` beside the usual rank variables, which then describe the group.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

GROUP_VAR = "DISTTRAIN_REPLICA_GROUP"
"""This rank's replica group, 0 to groups - 1 (its fixed slot of the data)."""
GROUPS_VAR = "DISTTRAIN_REPLICA_GROUPS"
"""How many replica groups the job runs."""
LIGHTHOUSE_VAR = "TORCHFT_LIGHTHOUSE"
"""The torchft lighthouse's address (torchft's own variable)."""
JOB_STORE_VAR = "DISTTRAIN_JOB_STORE"
"""``host:port`` of the job's own store, where the groups of the first start wait for each other."""
FAULT_TIME_VAR = "DISTTRAIN_GROUP_FAULT_TIME"
"""Set for a restarted group: when its previous start failed (seconds since the epoch), to time its rejoining."""
MEMBERSHIP_FILE = "membership.jsonl"
"""In the log folder: one line per change of the groups taking part in steps, and per group's first step."""
BEAT_KEY = "disttrain/group_beat/"
"""Prefix of the keys in a group's store where its ranks leave a heartbeat (plus the rank) for the job."""


def beat_value(when: float, steps: int) -> str:
    """A heartbeat: when it was sent (seconds since the epoch) and the steps the rank's group had committed."""
    return f"{when!r} {steps}"


def read_beat(value: bytes | str) -> tuple[float, int | None]:
    """``beat_value``'s time and steps (None in a beat that carries no count)."""
    parts = (value.decode() if isinstance(value, bytes) else value).split()
    return float(parts[0]), int(parts[1]) if len(parts) > 1 else None


def replica_group() -> tuple[int, int] | None:
    """``(group, groups)`` when the job started this rank in a replica group, else None."""
    if GROUP_VAR not in os.environ:
        return None
    return int(os.environ[GROUP_VAR]), int(os.environ[GROUPS_VAR])


def job_world_size(group_world: int) -> int | None:
    """The whole job's rank count when this rank belongs to a replica group (every group has ``group_world``
    ranks), else None: validation checks the degrees against the job, not the group."""
    group = replica_group()
    return group_world * group[1] if group is not None else None


def group_view(run: Any) -> Any:
    """``run`` (validated for the whole job) as one replica group sees it: the same batch and options, the degrees
    without the replicate dimension (each group builds its own mesh over its own ranks). Group 0 alone writes the
    loggers' rows (every group's rank 0 is its world's rank 0, and the rows are the same in every group); a
    restarted group 0 continues them from the step it healed at. The other groups keep their rows in a CSV file
    of their own, for the steps group 0 missed (``replica_rows``)."""
    from disttrain.fault.replica_rows import shadow_logger

    layout = dataclasses.replace(run.layout, dp_replicate=1)
    group = replica_group()
    train = run.train
    if group is not None and group[0] != 0:
        train = dataclasses.replace(train, logger=shadow_logger(train.logger, train.run_dir, group[0]))
    return dataclasses.replace(run, layout=layout, train=train)
