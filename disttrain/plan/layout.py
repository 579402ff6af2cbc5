"""What a candidate layout is and where the model's parts live in it: degrees, batch split and state bytes;
pipeline stages' units and the parameters on each rank."""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.parallel.config import accumulates_sharded
from disttrain.parallel.dims import ParallelDims
from disttrain.plan.model_stats import ModelStats
from disttrain.plan.recorder import ROOT

CHECKPOINT_POLICIES = ("none", "full", "selective")
"""Values of ``parallel.activation_checkpoint``, from the most memory to the least recompute."""

OPTIMISER_STATE_BYTES = {"adamw": 8, "lamb": 8, "lars": 4}
"""Optimiser state per fp32 parameter element: two moments for Adam-style, one momentum buffer for LARS."""


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter element of model state."""

    param: float = 4
    """Parameters as the model computes with them (fp32 here; the ZeRO paper's fp16 copies: 2)."""
    grad: float = 4
    """Gradients."""
    optim: float = 8
    """Optimiser state (the paper's K, which includes an fp32 master copy under mixed precision)."""
    zero2_keeps_shards: bool = True
    """ZeRO-2 holds parameter shards beside the gathered parameters (FSDP2); False: the paper's P_os+g."""


def state_bytes(optimiser: str, momentum: float = 0.0) -> StateBytes:
    """State bytes of a run of this framework: fp32 parameters and gradients (bf16-mixed autocasts on the fly),
    and the optimiser's state."""
    optim = OPTIMISER_STATE_BYTES.get(optimiser, 4 if momentum else 0)
    return StateBytes(optim=optim)


@dataclass(frozen=True)
class Layout(ParallelDims):
    """A candidate run: its degrees (``ParallelDims``), ZeRO stage, checkpointing and batch split. It exists for
    layouts no config names yet (``parallel=auto`` weighs many)."""

    zero_stage: int = 0
    """ZeRO stage of the dp_shard dimension (sharded over dp_shard x cp)."""
    activation_checkpoint: str = "none"
    """Checkpointing policy of the shard units (``CHECKPOINT_POLICIES``): none; full (keep each unit's input,
    recompute its forward in backward); selective (keep also the outputs of its matrix products and attention,
    recompute the rest)."""
    checkpoint_every_n_blocks: int = 1
    """The policy applies to every n-th shard unit only (``policy_of_units``); the others keep everything."""
    sequence_parallel: bool = False
    """Shard norms and dropout along the sequence too (tp > 1)."""
    micro_size: int = 1
    """Samples per rank per forward."""
    accumulation: int = 1
    """Micro-batches per optimiser step."""
    microbatches: int = 1
    """Pipeline microbatches each micro-batch is split into (pp > 1)."""
    schedule: str = "1f1b"
    """Pipeline schedule (pp > 1)."""
    stages_per_rank: int = 1
    """Pipeline stages per rank (interleaved schedules)."""
    accumulate_grads: str = "auto"
    """``parallel.accumulate_grads``: where ZeRO-2/3 accumulate gradients between micro-batches."""

    @property
    def state_shards(self) -> int:
        """Ranks one copy of the model state is sharded over: dp_shard x cp under ZeRO (ZeRO-1 with cp > 1 is
        refused), none without."""
        return self.shard_degree if self.zero_stage else 1

    @property
    def expert_state_shards(self) -> int:
        """Ranks one copy of an expert's state is sharded over: dp_shard / ep x cp under ZeRO (expert parallelism
        needs ZeRO-2/3; each rank holds 1/ep of the experts besides), none without."""
        return self.expert_shard_degree if self.zero_stage else 1

    @property
    def sharded_accumulation(self) -> bool:
        """Accumulation micro-batches reduce-scatter into gradient shards (ZeRO-2/3 without pipelining)."""
        return self.pp == 1 and accumulates_sharded(self.zero_stage, self.accumulate_grads)

    @property
    def whole_grads(self) -> bool:
        """Each rank holds its gradients unsharded at their largest: no ZeRO-2/3, or micro-batches that
        accumulate whole gradients before one reduce-scatter."""
        return self.zero_stage < 2 or (self.accumulation > 1 and not self.sharded_accumulation)

    def describe(self) -> str:
        """Short text, e.g. ``dp_shard=4 ep=2 cp=2 zero3 tp=2 ac=selective micro=8x2`` (``ac=full every 2`` when the
        policy covers every second unit)."""
        parts = [f"{k}={v}" for k, v in (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard),
                                         ("ep", self.ep), ("cp", self.cp), ("tp", self.tp), ("pp", self.pp))
                 if v > 1] or ["single"]
        if self.zero_stage:
            parts.append(f"zero{self.zero_stage}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.activation_checkpoint != "none":
            every = self.checkpoint_every_n_blocks
            parts.append(f"ac={self.activation_checkpoint}" + (f" every {every}" if every > 1 else ""))
        if self.pp > 1:
            parts.append(f"{self.schedule} m={self.microbatches}")
        parts.append(f"micro={self.micro_size}x{self.accumulation}")
        return " ".join(parts)


def policy_of_units(units: list[str], policy: str, every: int) -> dict[str, str]:
    """The checkpointing policy of each shard unit (in forward order): ``policy`` on the every-th, 2 every-th,
    ... unit counting from 1 (all of them for 1), ``none`` on the others."""
    return {unit: policy if (i + 1) % every == 0 else "none" for i, unit in enumerate(units)}


def within(name: str, unit: str) -> bool:
    """Whether the module path ``name`` is ``unit`` or lies inside it (the root unit ``""`` holds only itself:
    no path starts with a dot)."""
    return name == unit or name.startswith(unit + ".")


def unit_on_rank(stats: ModelStats, unit: str, units: list[str] | None) -> bool:
    """Whether what was charged to ``unit`` (saved bytes, operators) runs on the pipeline rank holding ``units``
    (None: the whole model); the root's own entries (the loss) belong to the last stage."""
    return (units is None or (unit == ROOT and stats.pipeline_units[-1] in units)
            or any(within(unit, x) for x in units))


def stage_units(stats: ModelStats, pp: int, stages_per_rank: int = 1) -> list[list[str]]:
    """Pipeline units of each rank, cut as the pipeline code cuts them (balanced by parameter count)."""
    from disttrain.parallel.pipeline.split import split_points

    units = stats.pipeline_units
    counts = [sum(n for name, n in stats.param_numel.items() if within(stats.param_unit[name], u)) for u in units]
    stages = pp * stages_per_rank
    points = [*split_points(len(units), stages, counts), len(units)]
    per_stage = [units[points[i]:points[i + 1]] for i in range(stages)]
    return [sum((per_stage[s] for s in range(rank, stages, pp)), []) for rank in range(pp)]


def rank_units(stats: ModelStats, layout: Layout) -> list[list[str] | None]:
    """Units each pipeline rank holds (None: the whole model)."""
    if layout.pp == 1:
        return [None]
    return stage_units(stats, layout.pp, layout.stages_per_rank)


def param_on_rank(stats: ModelStats, name: str, units: list[str] | None) -> bool:
    """Whether parameter ``name`` lives on the pipeline rank holding ``units`` (None: the whole model)."""
    if units is None:
        return True
    owner = stats.param_unit[name]
    return any(within(owner, u) for u in units)


def rank_params(stats: ModelStats, layout: Layout, units: list[str] | None) -> float:
    """Parameter elements on a rank before data-parallel sharding: its stages', split by tensor parallelism."""
    return sum(n / (layout.tp if stats.tp_sharded.get(name) else 1)
               for name, n in stats.param_numel.items() if param_on_rank(stats, name, units))


def rank_expert_params(stats: ModelStats, layout: Layout, units: list[str] | None) -> float:
    """The part of ``rank_params`` that is experts' (all of a stage's experts: expert parallelism's split comes
    after, with the data-parallel one)."""
    return sum(n / (layout.tp if stats.tp_sharded.get(name) else 1) for name, n in stats.param_numel.items()
               if name in stats.expert_params and param_on_rank(stats, name, units))


def expert_degrees(stats: ModelStats, dp_shard: int, zero_stage: int) -> list[int]:
    """Expert-parallel degrees a layout with ``dp_shard`` and ``zero_stage`` can take: 1, and for a model with
    experts under ZeRO-2/3 each divisor of dp_shard that divides every layer's number of experts."""
    if not stats.has_experts or zero_stage < 2:
        return [1]
    return [ep for ep in range(1, dp_shard + 1)
            if dp_shard % ep == 0 and all(n % ep == 0 for n in stats.expert_counts)]


def local_params(layout: Layout, params: float, experts: float) -> float:
    """Parameter elements a rank holds whole between data-parallel sharding and ``params`` of its stage (of which
    ``experts`` are experts'): all but the experts of the other ep ranks."""
    return params - experts + experts / layout.ep
