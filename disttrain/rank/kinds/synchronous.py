"""Synchronous data and model parallelism: DDP, ZeRO-1/2/3, HSDP, tensor parallelism; every rank steps on the
same averaged gradient every step (the behaviour ``RunKind`` defines)."""

from __future__ import annotations

from disttrain.rank.kinds.base import RunKind


class Synchronous(RunKind):
    """Every optimiser step exchanges gradients through DDP or FSDP2."""

    name = "synchronous"
