"""``parallel=auto``: the layout that fits in memory and has the smallest predicted step time.

Candidates: every split of the world into ``pp x dp x tp`` the model supports (tp within a node, dividing
the heads; pp no deeper than the pipeline units), each data-parallel way (replicas, ZeRO-1/2/3, and hybrid
sharding within a node), with and without activation checkpointing, and micro-batches from the largest that
divides the batch down; pipelines with 1F1B and 2 or 4 microbatches per stage. Predictions within
``TIE`` of the fastest count as a tie, which goes to the simplest layout.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from disttrain.plan.estimate import Estimate
from disttrain.plan.inputs import PlanInputs
from disttrain.plan.layout import Layout
from disttrain.plan.units import human_bytes

TIE = 0.03
"""Relative step-time difference below which two layouts count as equally fast."""


@dataclass
class Choice:
    """What ``parallel=auto`` chose and what it weighed."""

    best: Estimate | None
    """The chosen layout's prediction (None: nothing fits)."""
    ranked: list[Estimate]
    """Layouts that fit, best first."""
    too_big: list[Estimate]
    """Layouts that do not fit (each at its smallest micro-batch), smallest first."""

    def reason(self, alternatives: int = 3) -> str:
        """Why: the chosen prediction, the runners-up, and the smallest layout that did not fit."""
        if self.best is None:
            if not self.too_big:
                return "no layout fits"
            closest = self.too_big[0]
            return f"no layout fits; closest: {closest.layout.describe()}: {closest.overflow()}"
        lines = [f"chose {_line(self.best)}"]
        lines += [f"  also fits: {_line(e)}" for e in self.ranked[1:1 + alternatives]]
        if self.too_big:
            lines.append(f"  does not fit: {self.too_big[0].layout.describe()}: {self.too_big[0].overflow()}")
        return "\n".join(lines)


def _line(e: Estimate) -> str:
    return (f"{e.layout.describe()}: {e.step_s * 1e3:.3g} ms/step predicted, {human_bytes(e.total_bytes)} of "
            f"{human_bytes(e.capacity)} per rank")


def complexity(layout: Layout) -> tuple:
    """Ordering of simplicity: fewer kinds of parallelism, lower ZeRO stage, no checkpointing, less accumulation."""
    return (layout.pp > 1, layout.tp > 1, layout.dp_replicate > 1 and layout.dp_shard > 1, layout.zero_stage,
            layout.activation_checkpointing, layout.accumulation)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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
        for pp in _divisors(world // tp):
            if pp > 1 and pp > pipeline_units:
                continue
            dp = world // (tp * pp)
            if global_batch % dp:
                continue
            for replicate, shard, stage in _data_parallel_ways(dp, tp, devices_per_node, pp):
                for ac in (False, True):
                    if ac and pp > 1:
                        continue
                    per_replica = global_batch // dp
                    group = []
                    for micro in reversed(_divisors(per_replica)):
                        base = Layout(pp=pp, dp_replicate=replicate, dp_shard=shard, tp=tp, zero_stage=stage,
                                      activation_checkpointing=ac, micro_size=micro,
                                      accumulation=per_replica // micro, accumulate_grads=accumulate_grads)
                        if pp == 1:
                            group.append(base)
                            continue
                        for per_stage in (2, 4):
                            m = pp * per_stage
                            if micro % m == 0:
                                group.append(replace(base, microbatches=m, schedule="1f1b"))
                    if group:
                        groups.append(group)
    return groups


def _data_parallel_ways(dp: int, tp: int, devices_per_node: int, pp: int) -> list[tuple[int, int, int]]:
    """(dp_replicate, dp_shard, zero_stage) ways to spread ``dp`` ranks."""
    if dp == 1:
        return [(1, 1, 0)]
    ways = [] if (tp > 1 or pp > 1) else [(dp, 1, 0), (1, dp, 1)]  # DDP cannot replicate tp/pp stages here
    ways += [(1, dp, 2), (1, dp, 3)]
    shard = max(1, devices_per_node // tp)
    if pp == 1 and 1 < shard < dp and dp % shard == 0:  # hybrid: shard within a node, replicate across
        ways += [(dp // shard, shard, 2), (dp // shard, shard, 3)]
    return ways


def choose(inputs: PlanInputs, world: int, global_batch: int, pipeline_units: int,
           valid: Callable[[Layout], bool] = lambda layout: True, accumulate_grads: str = "auto") -> Choice:
    """The fastest layout that fits (ties to the simplest), from ``candidate_layouts`` that ``valid`` accepts."""
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
        return Choice(None, [], too_big)
    fastest = min(e.step_s for e in fitting)
    ties = [e for e in fitting if e.step_s <= fastest * (1 + TIE)]
    best = min(ties, key=lambda e: (complexity(e.layout), e.step_s))
    ranked = [best] + sorted((e for e in fitting if e is not best), key=lambda e: e.step_s)
    return Choice(best, ranked, too_big)
