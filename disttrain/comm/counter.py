"""Bytes on the wire, counted where disttrain calls a collective, and the fp32 ring all-reduce they replace."""

from __future__ import annotations


def ring_allreduce_bytes(numel: int, itemsize: int, world: int) -> int:
    """Bytes each rank sends in a ring all-reduce of ``numel`` elements: 2 (N - 1) / N of the payload
    (a reduce-scatter and an all-gather, each passing N - 1 of the N chunks)."""
    return 2 * (world - 1) * numel * itemsize // world


class ByteCounter:
    """Bytes this rank sent through disttrain's own collective calls."""

    def __init__(self) -> None:
        self.bytes_sent = 0
        """Running total since the process started."""

    def add(self, nbytes: int) -> None:
        """Count ``nbytes`` sent by this rank."""
        self.bytes_sent += int(nbytes)
