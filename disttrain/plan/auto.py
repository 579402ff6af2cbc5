"""``parallel=auto``: the layout that fits in memory and has the smallest predicted step time.

Candidates: every split of the world into ``pp x dp x cp x tp`` the model supports (tp within a node,
dividing the heads; cp for a model with attention over sequences that split into 2 cp chunks; pp no deeper
than the pipeline units), each data-parallel way (replicas, ZeRO-1/2/3, and hybrid sharding within a node;
ZeRO-2/3 only with cp and tp or pp), for a model with experts each expert-parallel degree under ZeRO-2/3 (a
divisor of dp_shard dividing every layer's experts), each activation-checkpointing policy (none, full,
selective, on every block), and micro-batches from the largest that divides the batch down; pipelines with 1F1B
and 2 or 4 microbatches per stage. The objective (``plan.objective``) is the predicted step time or the predicted
energy per token; predictions within ``TIE`` of the best count as a tie, which goes to the simplest layout.
Candidates a setting of the run refuses (``trainer.compile`` and pipelines, say: ``Refusal``) are left out of the
choice and its runners-up, and reported apart (``Exclusion``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from disttrain.errors import ConfigError, Refusal
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
class Exclusion:
    """The candidates one setting refused (one ``Refusal`` rule: its setting and what it excludes), left out of the
    choice and its runners-up and predicted all the same: what the setting costs the run, or that it alone stands
    between the run and a layout that fits."""

    refusal: Refusal
    """The refusal of the first candidate it refused (its ``setting`` and ``excludes`` are every one's)."""
    count: int = 0
    """Candidate layouts it refused, each micro-batch split counted."""
    fitting: list[Estimate] = field(default_factory=list)
    """Of each refused group of candidates (degrees and options), the first micro-batch split that fits."""

    def best(self, objective: str) -> Estimate | None:
        """The refused layout ``parallel=auto`` would pick (``pick``) were the setting other; None: none fits."""
        return pick(self.fitting, objective) if self.fitting else None

    def line(self, objective: str) -> str:
        """``excluded by trainer.compile=true: pipelines (...), 4 candidate(s); the best of them: ...``."""
        best = self.best(objective)
        return (f"excluded by {self.refusal.setting}: {self.refusal.excludes}, {self.count} candidate(s); "
                + (f"the best of them: {_line(best)}" if best else "none of them fits"))


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
    excluded: list[Exclusion] = field(default_factory=list)
    """The candidates the run's settings refuse, one ``Exclusion`` per rule (in none of the lists above)."""

    def reason(self, alternatives: int = 3) -> str:
        """Why: the chosen prediction and what the other objective would have picked, the runners-up, the
        smallest layout that did not fit, and the layouts the run's settings excluded."""
        excluded = [x.line(self.objective) for x in self.excluded]
        if self.best is None:
            if not self.too_big:
                return "; ".join(["no layout fits", *excluded])
            closest = self.too_big[0]
            return "; ".join([f"no layout fits; closest: {closest.layout.describe()}: {closest.overflow()}",
                              *excluded])
        lines = [f"chose {_line(self.best)} ({self.objectives_line()})"]
        lines += [f"  also fits: {_line(e)}" for e in self.ranked[1:1 + alternatives]]
        if self.too_big:
            lines.append(f"  does not fit: {self.too_big[0].layout.describe()}: {self.too_big[0].overflow()}")
        return "\n".join([*lines, *(f"  {line}" for line in excluded)])

    def refused(self, where: str) -> ConfigError | None:
        """Where no allowed layout fits ``where`` (``2 rank(s) of ...``), the error that names the setting in the
        way: the one that refused the best layout that fits (and the others that refused layouts that fit), or,
        where the settings leave no candidate at all, the one that refused the most. None where a layout was
        chosen, or where no layout would fit whatever the settings (the planner's own error then)."""
        if self.best is not None or not self.excluded:
            return None
        value = OBJECTIVES[self.objective]
        fitting = sorted(((x, best) for x in self.excluded if (best := x.best(self.objective)) is not None),
                         key=lambda pair: value(pair[1]))
        if not fitting and self.too_big:
            return None
        if not fitting:
            r = max(self.excluded, key=lambda x: x.count).refusal
            found = "which is every layout it weighs"
        else:
            r, best = fitting[0][0].refusal, fitting[0][1]
            found = (f"and only those fit (the best: {best.layout.describe()})" if len(fitting) == 1 else
                     f"among them the best layout that fits ({best.layout.describe()}); the others that fit are "
                     "refused by " + "; ".join(f"{x.refusal.setting}: {x.refusal.excludes}" for x, _ in fitting[1:]))
        return ConfigError(r.key, r.value, f"{r.instead} with parallel=auto on {where}: it refuses {r.excludes}, "
                           f"{found}")

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
           objective: str = "time", refusal_of: Callable[[Layout], Refusal | None] = lambda layout: None) -> Choice:
    """The layout that fits with the least ``objective`` (``OBJECTIVES``; ties to the simplest), from
    ``candidate_layouts`` that ``valid`` accepts and the run's settings allow (``refusal_of``: the ``Refusal`` of a
    layout, None where they allow it); what each objective would pick beside it, and what the settings excluded."""
    fitting, too_big, excluded = [], [], {}
    for group in candidate_layouts(world, global_batch, inputs, pipeline_units, inputs.profile.devices_per_node,
                                   accumulate_grads):
        allowed, refused = [], {}
        for layout in filter(valid, group):
            refusal = refusal_of(layout)
            if refusal is None:
                allowed.append(layout)
            else:
                refused.setdefault((refusal.setting, refusal.excludes), []).append((layout, refusal))
        fits, last = _first_fit(inputs, allowed)
        if fits is not None:
            fitting.append(fits)
        elif last is not None:
            too_big.append(last)
        for rule, layouts in refused.items():
            exclusion = excluded.setdefault(rule, Exclusion(layouts[0][1]))
            exclusion.count += len(layouts)
            fits, _ = _first_fit(inputs, [layout for layout, _ in layouts])
            exclusion.fitting += [fits] if fits is not None else []
    too_big.sort(key=lambda e: e.total_bytes - e.capacity)
    if not fitting:
        return Choice(None, [], too_big, objective, excluded=list(excluded.values()))
    powered = inputs.profile.watts is not None
    by_objective = {name: pick(fitting, name) if name == "time" or powered else None for name in OBJECTIVES}
    best = by_objective[objective]
    ranked = [best] + sorted((e for e in fitting if e is not best), key=OBJECTIVES[objective])
    return Choice(best, ranked, too_big, objective, by_objective, list(excluded.values()))


def _first_fit(inputs: PlanInputs, group: list[Layout]) -> tuple[Estimate | None, Estimate | None]:
    """The first layout of ``group`` (micro-batches from the largest down) that fits, predicted, and the last one
    predicted (the smallest micro-batch where none fits; None for an empty group)."""
    last = None
    for layout in group:
        last = inputs.estimate(layout)
        if last.fits:
            return last, last
    return None, last
