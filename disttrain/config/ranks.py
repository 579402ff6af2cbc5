"""A range of ranks (``trainer.devices=2:4``, ``trainer.num_nodes=1:4``): the counts a run may train on, and
the batch that stays the same on every one of them.

Under disttrain's own supervisor a run starts on the range's largest count and, when a rank fails, restarts on
the largest count the remaining devices, the layout and the global batch allow (``elastic_worlds``). Under an
external launcher (torchrun ``--nnodes=MIN:MAX``, SLURM) the launcher decides; each rank checks that its world
lies inside the range. Either way the global batch is the one the largest world resolves
(``elastic_batch``), so a change of ranks changes the accumulation (or, where the user fixed the accumulation,
the micro-batch) and never the optimisation.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from disttrain.config.batch import resolve_batch
from disttrain.config.schema import BatchConfig, TrainConfig, TrainerConfig
from disttrain.errors import ConfigError


@dataclass(frozen=True)
class RankRange:
    """``MIN:MAX`` of one trainer key."""

    key: str
    """The config key it came from (``trainer.devices`` or ``trainer.num_nodes``)."""
    low: int
    """The fewest ranks (or nodes) the run may train on."""
    high: int
    """The most, which it starts on."""

    @property
    def text(self) -> str:
        """As the user wrote it."""
        return f"{self.low}:{self.high}"

    def __contains__(self, count: int) -> bool:
        return self.low <= count <= self.high


def parse_range(key: str, value: Any, unit: str) -> RankRange | None:
    """``value`` as a ``RankRange`` if it is a ``MIN:MAX`` string, else None; ConfigError if it is a malformed
    one. ``unit``: what it counts, for the message."""
    if not isinstance(value, str) or ":" not in value:
        return None
    allowed = f"MIN:MAX {unit} with 1 <= MIN <= MAX (e.g. 2:4), or one number"
    low_text, _, high_text = value.partition(":")
    try:
        low, high = int(low_text), int(high_text)
    except ValueError:
        raise ConfigError(key, value, allowed) from None
    if low < 1 or low > high:
        raise ConfigError(key, value, allowed)
    return RankRange(key, low, high)


def elastic_batch(batch: BatchConfig, dp_largest: int) -> BatchConfig:
    """The batch settings of a run whose data-parallel size may change: the global batch resolved on the largest
    world (``dp_largest`` ranks), kept; the micro-batch kept where the user set it (its memory was chosen), the
    accumulation following; else the user's accumulation (1 if unset) kept and the micro-batch following."""
    largest = resolve_batch(batch, dp_largest)
    if batch.micro_size is not None:
        return BatchConfig(largest.global_size, batch.micro_size, None)
    return BatchConfig(largest.global_size, None, batch.accumulation)


def elastic_worlds(devices: RankRange, num_nodes: int, runs_on: Callable[[int], None]) -> tuple[int, ...]:
    """The world sizes, largest first, that a run of ``devices`` ranks per node on ``num_nodes`` nodes may
    restart on: those ``runs_on(world)`` accepts (it raises ConfigError for a world the layout or the batch
    refuses). ConfigError naming ``devices`` if the smallest count of the range is not among them."""
    allowed, refusal = [], None
    for per_node in range(devices.high, devices.low - 1, -1):
        try:
            runs_on(per_node * num_nodes)
        except ConfigError as err:
            if per_node == devices.low:
                refusal = err
            continue
        allowed.append(per_node * num_nodes)
    if refusal is not None:
        counts = ", ".join(str(world // num_nodes) for world in allowed)
        raise ConfigError(devices.key, devices.text, f"a range whose smallest count the layout and the global "
                          f"batch allow; {devices.low} does not ({refusal}); counts from {devices.low} to "
                          f"{devices.high} that do: {counts}")
    return tuple(allowed)


def check_launched_world(devices: RankRange | None, nodes: RankRange | None, per_node: int, world: int) -> None:
    """Under an external launcher: its ranks per node and nodes must lie in the ranges the config gives."""
    if devices is not None and per_node not in devices:
        raise ConfigError(devices.key, devices.text, f"a range that holds the launcher's {per_node} ranks per node "
                          "(LOCAL_WORLD_SIZE)")
    node_count = max(1, world // max(1, per_node))
    if nodes is not None and node_count not in nodes:
        raise ConfigError(nodes.key, nodes.text, f"a range that holds the launcher's {node_count} nodes "
                          f"(WORLD_SIZE {world} / {per_node} ranks per node)")


def launched() -> bool:
    """Whether a launcher started this process as one rank (torchrun, SLURM, disttrain's supervisor)."""
    return "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def rank_ranges(t: TrainerConfig) -> tuple[RankRange | None, RankRange | None]:
    """``trainer.devices`` and ``trainer.num_nodes`` as ranges where they are ``MIN:MAX``; each key then holds the
    range's largest count, which the run starts on. Under an external launcher its world must lie in the
    ranges; under disttrain's supervisor, which starts every rank on this machine, nodes are one number."""
    devices = parse_range("trainer.devices", t.devices, "ranks per node")
    nodes = parse_range("trainer.num_nodes", t.num_nodes, "nodes")
    if devices is not None:
        t.devices = devices.high
    if nodes is not None:
        t.num_nodes = nodes.high
    if launched():
        world = int(os.environ["WORLD_SIZE"])
        check_launched_world(devices, nodes, int(os.environ.get("LOCAL_WORLD_SIZE") or world), world)
    elif nodes is not None:
        raise ConfigError(nodes.key, nodes.text, "one number under disttrain's own supervisor, which starts every "
                          "rank on this machine; a range of nodes needs a launcher that adds and removes nodes "
                          "(torchrun --nnodes=MIN:MAX)")
    elif devices is not None and t.num_nodes != 1:
        raise ConfigError("trainer.num_nodes", t.num_nodes, f"1 with trainer.devices={devices.text} under disttrain's "
                          "own supervisor, which starts every rank on this machine (several nodes: torchrun "
                          "--nnodes=MIN:MAX)")
    return devices, nodes


def restart_worlds(top: TrainConfig, kind: str, given: RankRange, runs_on: Any) -> tuple[int, ...]:
    """For a range of ranks: the world sizes disttrain's supervisor may restart on, largest first (none under a
    launcher, which decides); ConfigError for a kind of run whose state does not move between world sizes."""
    if kind not in ("synchronous", "pipelined"):
        raise ConfigError(given.key, given.text, f"one number for a {kind.replace('_', ' ')} run (a range needs "
                          "synchronous or pipelined training, whose state moves between world sizes)")
    if given.key != "trainer.devices" or launched():
        return ()
    return elastic_worlds(given, top.trainer.num_nodes, runs_on)


def largest_world(t: TrainerConfig, devices: RankRange | None, nodes: RankRange | None, world: int) -> int:
    """The most ranks the ranges allow: this world's ranks per node and nodes where no range is given."""
    if not launched():
        return t.devices * t.num_nodes
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or world)
    return (devices.high if devices else per_node) * (nodes.high if nodes else max(1, world // per_node))
