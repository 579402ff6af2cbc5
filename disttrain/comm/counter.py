"""Bytes on the wire, counted where disttrain calls a collective, and the fp32 ring all-reduce they replace."""

from __future__ import annotations


def ring_allreduce_bytes(numel: int, itemsize: int, world: int) -> int:
    """Bytes each rank sends in a ring all-reduce of ``numel`` elements: 2 (N - 1) / N of the payload
    (a reduce-scatter and an all-gather, each passing N - 1 of the N chunks)."""
    return 2 * (world - 1) * numel * itemsize // world


def ring_allreduce_messages(world: int) -> int:
    """Messages each rank sends, one after another, in a ring all-reduce: N - 1 in each of its two phases."""
    return 2 * (world - 1)


def sharded_bytes(numel: int, shard: int, replicate: int, reduce_itemsize: int, param_itemsize: int,
                  gathers: int) -> int:
    """Bytes each rank sends per step under FSDP2 (ZeRO-2/3, hybrid sharding over ``replicate`` groups of
    ``shard`` ranks), as ring collectives: the gradients' reduce-scatter, the all-reduce of each gradient
    shard over the replicas, and the parameters' all-gather ``gathers`` times (``Layout.gathers_per_microbatch``:
    twice for ZeRO-3, again in backward)."""
    reduce_scatter = (shard - 1) * numel * reduce_itemsize // shard
    across_replicas = ring_allreduce_bytes(numel // shard, reduce_itemsize, replicate)
    all_gather = (shard - 1) * numel * param_itemsize // shard
    return reduce_scatter + across_replicas + all_gather * gathers


class ByteCounter:
    """Bytes and messages this rank sent through disttrain's own collective calls."""

    def __init__(self) -> None:
        self.bytes_sent = 0
        """Running total of bytes since the process started."""
        self.messages = 0
        """Running total of messages sent one after another (what the latency term of a link multiplies)."""

    def add(self, nbytes: int, messages: int = 0) -> None:
        """Count ``nbytes`` sent by this rank in ``messages`` sequential messages."""
        self.bytes_sent += int(nbytes)
        self.messages += int(messages)
