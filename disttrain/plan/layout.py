"""What a candidate layout is and where the model's parts live in it: degrees, batch split and state bytes;
pipeline stages' units and the parameters on each rank."""

from __future__ import annotations

from dataclasses import dataclass, field

from disttrain.parallel.layout import Layout as RunLayout
from disttrain.plan.model_stats import ModelStats
from disttrain.plan.recorder import ROOT

CHECKPOINT_POLICIES = ("none", "full", "selective")
"""Values of ``parallel.activation_checkpoint``, from the most memory to the least recompute."""

OPTIMISER_STATE_BYTES = {"adamw": 8, "lamb": 8, "lars": 4, "onebit_adam": 12}
"""Optimiser state per fp32 parameter element: two moments for Adam-style, one momentum buffer for LARS; 1-bit Adam
also keeps its worker residual (its server residual, 1 / N of it, is left out)."""


@dataclass(frozen=True)
class MatrixStep:
    """What an optimiser that steps whole matrices (Muon, SOAP) adds to a plan: the parameters it steps as matrices,
    their state, and what it computes per optimiser step (``disttrain.plan.matrix_step``)."""

    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    """Parameter name -> whole shape of each matrix (2-D) or stack of matrices (3-D, MoE experts) it steps."""
    state: float = 4
    """State bytes per element of those matrices (Muon's fp32 momentum buffer, laid out like the parameter)."""
    other_state: float = 8
    """State bytes per element of every other parameter (AdamW's two fp32 moments)."""
    ns_steps: int = 5
    """Newton-Schulz iterations per matrix and optimiser step."""
    ns_dtype: str = "bfloat16"
    """The iteration's dtype (bfloat16 or float32): which of the profile's peak rates it computes at."""
    kind: str = "muon"
    """muon (``state`` per value, laid out like the parameter; Newton-Schulz) or soap (L, R, QL, QR and both
    moments whole on every rank of a matrix's shard group, ``precondition_bytes`` per value; eigendecompositions)."""
    precondition_bytes: int = 4
    """SOAP: bytes per value of its state (its ``precondition_dtype``'s)."""
    precondition_frequency: int = 1
    """SOAP: optimiser steps between eigendecompositions."""
    heads: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Parameter name -> (axis, width) of each attention projection stepped per head (``optim.per_head``: its heads
    are blocks of ``width`` along ``axis``, 0 rows or 1 columns; see ``disttrain.models.heads``)."""


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
    matrices: MatrixStep | None = None
    """Where the optimiser steps whole matrices (Muon, SOAP): which, and how (``optim`` is then a rank's mean, set per
    layout by ``disttrain.plan.matrix_step.rank_state``)."""


def state_bytes(optimiser: str, momentum: float = 0.0) -> StateBytes:
    """State bytes of a run of this framework: fp32 parameters and gradients (bf16-mixed autocasts on the fly),
    and the optimiser's state."""
    optim = OPTIMISER_STATE_BYTES.get(optimiser, 4 if momentum else 0)
    return StateBytes(optim=optim)


@dataclass(frozen=True)
class Layout(RunLayout):
    """A candidate of the plan: a run's layout (``disttrain.parallel.layout.Layout``: degrees, ZeRO stage,
    checkpointing) with the batch split and pipeline schedule it is weighed with. It exists for layouts no config
    names yet (``parallel=auto`` weighs many)."""

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

    @property
    def stage_keeps_whole(self) -> bool:
        """A pipeline stage under ZeRO-2/3: torch's stage turns FSDP2's gradient sync and its resharding after
        backward off for every microbatch's backward and reduces once when the schedule's step ends, so from the
        first backward on the stage holds its whole parameters (beside their shards) and whole gradients."""
        return self.pp > 1 and self.shards_parameters

    @property
    def whole_grads(self) -> bool:
        """Each rank holds its gradients unsharded at their largest: no ZeRO-2/3, micro-batches that
        accumulate whole gradients before one reduce-scatter, or a pipeline stage (``stage_keeps_whole``)."""
        return (not self.shards_gradients or (self.accumulation > 1 and not self.sharded_accumulation)
                or self.stage_keeps_whole)

    def describe(self) -> str:
        """Short text, e.g. ``dp_shard=4 ep=2 cp=2 zero3 tp=2 ac=selective micro=8x2`` (``ac=full every 2`` when the
        policy covers every second unit)."""
        parts = [super().describe()]
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


def expert_degrees(stats: ModelStats, dp_shard: int, shards_parameters: bool) -> list[int]:
    """Expert-parallel degrees a layout with ``dp_shard`` can take: 1, and for a model with experts under ZeRO-2/3
    (``shards_parameters``) each divisor of dp_shard that divides every layer's number of experts."""
    if not stats.has_experts or not shards_parameters:
        return [1]
    return [ep for ep in range(1, dp_shard + 1)
            if dp_shard % ep == 0 and all(n % ep == 0 for n in stats.expert_counts)]


def local_params(layout: Layout, params: float, experts: float) -> float:
    """Parameter elements a rank holds whole between data-parallel sharding and ``params`` of its stage (of which
    ``experts`` are experts'): all but the experts of the other ep ranks."""
    return params - experts + experts / layout.ep
