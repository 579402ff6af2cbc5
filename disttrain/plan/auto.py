"""``parallel=auto``: the layout that fits in memory and has the smallest predicted step time.

Candidates: every split of the world into ``pp x dp x cp x tp`` the model supports (tp within a node,
dividing the heads; cp for a model with attention over sequences that split into 2 cp chunks; pp no deeper
than the pipeline units), each data-parallel way (replicas, ZeRO-1/2/3, and hybrid sharding within a node;
ZeRO-2/3 only with cp and tp or pp), for a model with experts each expert-parallel degree under ZeRO-2/3 (a
divisor of dp_shard dividing every layer's experts), each activation-checkpointing policy (none, full,
selective, on every block), and micro-batches from the largest that divides the batch down; pipelines with 1F1B
and 2 or 4 microbatches per stage. The objective (``plan.objective``) is the predicted step time or the predicted
energy per token; predictions within ``TIE`` of the best count as a tie, which goes to the simplest layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from disttrain.plan.estimate import Estimate
from disttrain.plan.inputs import PlanInputs
from disttrain.plan.layout import CHECKPOINT_POLICIES, Layout, expert_degrees
from disttrain.plan.model_stats import ModelStats
from disttrain.plan.units import human_bytes

TIE = 0.03
"""Relative difference of the objective below which two layouts count as equally good."""

OBJECTIVES: dict[str, Callable[[Estimate], float]] = {
    "time": lambda e: e.step_s,
    "energy": lambda e: e.joules_per_token,
}
"""What ``parallel=auto`` can minimise (``plan.objective``): the predicted step time, or the predicted joules per
token (``Estimate.joules_per_token``; only on a profile with a power figure)."""


@dataclass
class Choice:
    """What ``parallel=auto`` chose and what it weighed."""

    best: Estimate | None
    """The chosen layout's prediction (None: nothing fits)."""
    ranked: list[Estimate]
    """Layouts that fit, best first."""
    too_big: list[Estimate]
    """Layouts that do not fit (each at its smallest micro-batch), smallest first."""
    objective: str = "time"
    """What the choice minimised (``OBJECTIVES``)."""
    by_objective: dict[str, Estimate | None] = field(default_factory=dict)
    """Objective -> the layout it picks among those that fit (None: energy on a profile without a power figure)."""

    def reason(self, alternatives: int = 3) -> str:
        """Why: the chosen prediction and what the other objective would have picked, the runners-up, and the
        smallest layout that did not fit."""
        if self.best is None:
            if not self.too_big:
                return "no layout fits"
            closest = self.too_big[0]
            return f"no layout fits; closest: {closest.layout.describe()}: {closest.overflow()}"
        lines = [f"chose {_line(self.best)} ({self.objectives_line()})"]
        lines += [f"  also fits: {_line(e)}" for e in self.ranked[1:1 + alternatives]]
        if self.too_big:
            lines.append(f"  does not fit: {self.too_big[0].layout.describe()}: {self.too_big[0].overflow()}")
        return "\n".join(lines)


    def objectives_line(self) -> str:
        """``objective time; energy would pick ...``: the objective chosen by and what each other one picks."""
        parts = [f"objective {self.objective}"]
        for name, pick in self.by_objective.items():
            if name == self.objective:
                continue
            if pick is None:
                parts.append(f"{name}: unknown, the profile has no power figure")
            elif pick is self.best:
                parts.append(f"{name} would pick the same")
            else:
                parts.append(f"{name} would pick {_line(pick)}")
        return "; ".join(parts)


def _line(e: Estimate) -> str:
    energy = e.joules_per_token
    return (f"{e.layout.describe()}: {e.step_s * 1e3:.3g} ms/step predicted"
            + (f", {energy * 1e3:.3g} mJ/token" if energy is not None else "")
            + f", {human_bytes(e.total_bytes)} of {human_bytes(e.capacity)} per rank")


SIMPLICITY = {"none": 0, "full": 1, "selective": 2}
"""Checkpointing policies from the simplest: none; full recomputes whole blocks; selective also picks operators."""


def complexity(layout: Layout) -> tuple:
    """Ordering of simplicity: fewer kinds of parallelism, lower ZeRO stage, simpler checkpointing, less
    accumulation."""
    zero = (layout.shards_optimizer_state, layout.shards_gradients, layout.reshards_after_forward)  # by stage
    return (layout.pp > 1, layout.tp > 1, layout.cp > 1, layout.ep > 1, layout.dp_replicate > 1 and layout.dp_shard > 1,
            zero, SIMPLICITY[layout.activation_checkpoint], layout.accumulation)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def splits_sequence(stats: ModelStats, cp: int) -> bool:
    """Whether ``cp`` context-parallel ranks can share the model's sequences: a text model (``tokens_per_sample``
    is its block size; 1 for other data) whose pass ran attention, with a block size that splits into 2 cp
    chunks (an early and a late one per rank). Models the runtime cannot split are refused when a run starts."""
    if cp == 1:
        return True
    has_attention = any(stats.attention_kv_bytes.values())
    return has_attention and stats.tokens_per_sample > 1 and stats.tokens_per_sample % (2 * cp) == 0


def candidate_layouts(world: int, global_batch: int, inputs: PlanInputs, pipeline_units: int,
                      devices_per_node: int, accumulate_grads: str = "auto") -> list[list[Layout]]:
    """Candidate layouts, grouped by parallel degrees and options; each group lists micro-batches from the
    largest down (the first that fits is the fastest of its group). ``accumulate_grads``: the run's
    ``parallel.accumulate_grads``, which every candidate keeps."""
    groups = []
    for tp in _divisors(world):
        if tp > 1 and (not inputs.has_tp_plan or tp > devices_per_node
                       or (inputs.num_heads and inputs.num_heads % tp)):
            continue
        for cp in _divisors(world // tp):
            if not splits_sequence(inputs.stats, cp):
                continue
            for pp in _divisors(world // (tp * cp)):
                if pp > 1 and pp > pipeline_units:
                    continue
                dp = world // (tp * cp * pp)
                if global_batch % dp:
                    continue
                for replicate, shard, stage in _data_parallel_ways(dp, tp, cp, devices_per_node, pp):
                    way = Layout.of_stage(stage, pp=pp, dp_replicate=replicate, dp_shard=shard, tp=tp, cp=cp,
                                          accumulate_grads=accumulate_grads)
                    for ep in expert_degrees(inputs.stats, shard, way.shards_parameters):
                        for policy in CHECKPOINT_POLICIES:
                            if (policy != "none" and pp > 1) or (policy == "selective" and ep > 1):
                                continue  # what the run refuses (``ParallelConfig.check_layout``)
                            group = _micro_batches(replace(way, ep=ep, activation_checkpoint=policy),
                                                   global_batch // dp)
                            if group:
                                groups.append(group)
    return groups


def _micro_batches(base: Layout, per_replica: int) -> list[Layout]:
    """``base`` at each micro-batch that divides ``per_replica`` samples, the largest first (pipelines: with 2
    and 4 microbatches per stage where they divide it)."""
    group = []
    for micro in reversed(_divisors(per_replica)):
        layout = replace(base, micro_size=micro, accumulation=per_replica // micro)
        if base.pp == 1:
            group.append(layout)
            continue
        for per_stage in (2, 4):
            m = base.pp * per_stage
            if micro % m == 0:
                group.append(replace(layout, microbatches=m, schedule="1f1b"))
    return group


def _data_parallel_ways(dp: int, tp: int, cp: int, devices_per_node: int, pp: int) -> list[tuple[int, int, int]]:
    """(dp_replicate, dp_shard, ZeRO stage) ways to spread ``dp`` ranks (ZeRO shards over dp_shard x cp)."""
    replicable = tp == 1 and pp == 1  # DDP cannot replicate tp/pp stages here
    if dp == 1:
        ways = [(1, 1, 0)] if cp == 1 or replicable else []
        return ways + ([(1, 1, 2), (1, 1, 3)] if cp > 1 else [])  # cp ranks alone share the state
    ways = [(dp, 1, 0)] if replicable else []
    ways += [(1, dp, 1)] if replicable and cp == 1 else []  # ZeRO-1 shards over dp only: refused with cp
    ways += [(1, dp, 2), (1, dp, 3)]
    shard = max(1, devices_per_node // (tp * cp))
    if pp == 1 and 1 < shard < dp and dp % shard == 0:  # hybrid: shard within a node, replicate across
        ways += [(dp // shard, shard, 2), (dp // shard, shard, 3)]
    return ways


def pick(fitting: list[Estimate], objective: str) -> Estimate:
    """The layout of ``fitting`` with the least ``objective`` (within ``TIE`` of it: the simplest)."""
    value = OBJECTIVES[objective]
    least = min(value(e) for e in fitting)
    ties = [e for e in fitting if value(e) <= least * (1 + TIE)]
    return min(ties, key=lambda e: (complexity(e.layout), value(e)))


def choose(inputs: PlanInputs, world: int, global_batch: int, pipeline_units: int,
           valid: Callable[[Layout], bool] = lambda layout: True, accumulate_grads: str = "auto",
           objective: str = "time") -> Choice:
    """The layout that fits with the least ``objective`` (``OBJECTIVES``; ties to the simplest), from
    ``candidate_layouts`` that ``valid`` accepts; what each objective would pick beside it."""
    fitting, too_big = [], []
    for group in candidate_layouts(world, global_batch, inputs, pipeline_units, inputs.profile.devices_per_node,
                                   accumulate_grads):
        group = [layout for layout in group if valid(layout)]
        estimates = (inputs.estimate(layout) for layout in group)
        last = None
        for last in estimates:
            if last.fits:
                fitting.append(last)
                break
        else:
            if last is not None:
                too_big.append(last)
    too_big.sort(key=lambda e: e.total_bytes - e.capacity)
    if not fitting:
        return Choice(None, [], too_big, objective)
    powered = inputs.profile.watts is not None
    by_objective = {name: pick(fitting, name) if name == "time" or powered else None for name in OBJECTIVES}
    best = by_objective[objective]
    ranked = [best] + sorted((e for e in fitting if e is not best), key=OBJECTIVES[objective])
    return Choice(best, ranked, too_big, objective, by_objective)
