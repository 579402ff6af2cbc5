"""Pipeline parallelism with ``torch.distributed.pipelining`` (plain functions, no Lightning).

A model is cut between its pipeline units (``pipeline_units()``, or ``parallel.pipeline_units``: ordered
submodules whose application in turn is the forward, see ``disttrain.models.protocol``) into
``pp * stages_per_rank`` contiguous stages. Each stage is a ``UnitStage`` that holds its units under the
full model's names (``blocks.3.attn.q.weight``), so a stage's state dict is a slice of the full one and
the checkpoints of all stages merge into one.

Placement: rank ``r`` holds stages ``r, r + pp, r + 2 pp, ...`` ("loop"), which serves GPipe, 1F1B,
interleaved 1F1B and interleaved zero bubble with one code path; ZBV needs the "v" placement, rank ``r``
holding stages ``r`` and ``2 pp - 1 - r`` (see ``stage_indices``).

Shared parameters: two units that share a parameter (a head tied to the token embedding) could land on
different stages, which would need extra communication; such a model is refused with pp > 1
(``check_units``).

Loss scaling: with ``scale_grads=True`` torch's schedules divide every stage's gradients by the number of
microbatches after the step. With a ``loss_fn`` that returns the microbatch *mean* cross-entropy, the
gradient is ``(1/m) sum_i grad(mean over microbatch i)``, which for equal-sized microbatches is the gradient
of the mean over the whole batch: the same objective (and gradient) as one process with the full batch.
``tests/test_pipeline_apply.py`` pins this for every schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from disttrain.errors import ConfigError
from disttrain.parallel.model_plan import pipeline_units_of

if TYPE_CHECKING:  # imported where stages are built: it imports torch._dynamo (slow), which validation needs not
    from torch.distributed.pipelining import PipelineStage

    from disttrain.models.heads import HeadBlocks

SCHEDULES: dict[str, str] = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved_1f1b": "Interleaved1F1B",
    "zero_bubble": "InterleavedZeroBubble",
    "zbv": "ZBVZeroBubble",
}
"""Our schedule names and the names ``torch.distributed.pipelining.get_schedule_class`` knows them by."""

SINGLE_STAGE = ("gpipe", "1f1b")
"""Schedules that run exactly one stage per rank."""


def split_points(
    num_units: int,
    stages: int,
    param_counts: Sequence[int] | None = None,
    explicit: Sequence[int] | None = None,
) -> list[int]:
    """The unit index at which each of ``stages`` contiguous stages starts (the first is always 0).

    ``explicit``: the start units of stages 1..stages-1 (a leading 0 may be given too), checked and returned.
    Otherwise the cut minimises the largest stage cost, a stage's cost being the sum of its units'
    ``param_counts`` (every unit 1 when None). Ties go to the earliest cut. ``ConfigError`` for more stages
    than units or bad points.
    """
    if stages < 1:
        raise ConfigError("parallel.pp", stages, "a positive number of pipeline stages")
    if stages > num_units:
        raise ConfigError("parallel.pp", stages,
                          f"at most {num_units} stages (pp x stages_per_rank): the model has {num_units} "
                          "pipeline units")
    if explicit is not None:
        points = [int(p) for p in explicit]
        if len(points) == stages - 1:
            points = [0, *points]
        ok = (len(points) == stages and points[0] == 0 and all(a < b for a, b in zip(points, points[1:], strict=False))
              and points[-1] < num_units)
        if not ok:
            raise ConfigError("parallel.pipeline.split_points", list(explicit),
                              f"{stages - 1} strictly increasing unit indices in 1..{num_units - 1}")
        return points
    costs = [1] * num_units if param_counts is None else [int(c) for c in param_counts]
    if len(costs) != num_units:
        raise ValueError(f"param_counts has {len(costs)} entries for {num_units} units")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(start: int, end: int) -> int:
        return prefix[end] - prefix[start]

    # best[s][j]: (largest stage cost, start points) for units 0..j-1 cut into s stages.
    inf = float("inf")
    best: list[list[tuple[float, list[int]]]] = [[(inf, [])] * (num_units + 1) for _ in range(stages + 1)]
    best[0][0] = (0, [])
    for s in range(1, stages + 1):
        last = s == stages
        for j in range(s, num_units - (stages - s) + 1):
            if last and j != num_units:
                continue
            for i in range(s - 1, j):
                prev, starts = best[s - 1][i]
                if prev == inf:
                    continue
                value = max(prev, cost(i, j))
                if value < best[s][j][0]:
                    best[s][j] = (value, [*starts, i])
    return best[stages][num_units][1]


def unit_split_points(model: nn.Module, units: Sequence[str], num_stages: int,
                      explicit: Sequence[int] | None = None) -> list[int]:
    """``split_points`` over ``units`` (names from ``pipeline_units_of``), balanced by parameter count
    (a parameter shared by several units counts once, at its first)."""
    seen: set[int] = set()
    costs = []
    for name in units:
        params = [p for p in model.get_submodule(name).parameters() if id(p) not in seen]
        seen.update(id(p) for p in params)
        costs.append(sum(p.numel() for p in params))
    return split_points(len(units), num_stages, costs, explicit)


def check_units(model: nn.Module, units: Sequence[str], pp: int, model_name: str) -> None:
    """ConfigError when two pipeline units share a parameter (they may land on different stages)."""
    owner: dict[int, tuple[str, str]] = {}
    for unit in units:
        for pname, param in model.get_submodule(unit).named_parameters():
            first = owner.setdefault(id(param), (unit, pname))
            if first[0] != unit:
                raise ConfigError("parallel.pp", pp, f"1 for model {model_name}: its pipeline units share a "
                                  f"parameter ({unit}.{pname} is {first[0]}.{first[1]}) and stages cannot share "
                                  "one; untie it (model.tie_weights=false, or +model.tie_word_embeddings=false "
                                  "for a transformers config)")


def stage_indices(rank: int, pp: int, stages_per_rank: int, style: str = "loop") -> list[int]:
    """The stages rank ``rank`` of ``pp`` holds, in the order its schedule expects.

    ``style="loop"``: stages ``rank, rank + pp, ...`` (every schedule but ZBV). ``style="v"``: exactly two
    stages, ``rank`` and ``2 pp - 1 - rank`` (ZBV: the first rank holds the first and the last stage).
    """
    if style == "v":
        if stages_per_rank != 2:
            raise ConfigError("parallel.pipeline.stages_per_rank", stages_per_rank, "2 for the 'v' placement (zbv)")
        return [rank, 2 * pp - 1 - rank]
    if style != "loop":
        raise ValueError(f"unknown stage placement {style!r}: 'loop' or 'v'")
    return [rank + k * pp for k in range(stages_per_rank)]


def placement(schedule: str) -> str:
    """Stage placement style a schedule needs: 'v' for zbv, else 'loop'."""
    return "v" if schedule == "zbv" else "loop"


def check_pipeline(
    schedule: str,
    pp: int,
    stages_per_rank: int,
    microbatches: int,
    batch_size: int,
    num_units: int,
) -> None:
    """Raise ``ConfigError`` for a pipeline that cannot run; ``batch_size`` is the batch each step splits
    into ``microbatches`` (per data-parallel rank)."""
    if schedule not in SCHEDULES:
        raise ConfigError("parallel.pipeline.schedule", schedule, f"one of {list(SCHEDULES)}")
    if pp < 1:
        raise ConfigError("parallel.pp", pp, "a positive integer")
    if schedule in SINGLE_STAGE and stages_per_rank != 1:
        raise ConfigError("parallel.pipeline.stages_per_rank", stages_per_rank, f"1 for the {schedule} schedule")
    if schedule == "zbv" and stages_per_rank != 2:
        raise ConfigError("parallel.pipeline.stages_per_rank", stages_per_rank, "2 for the zbv schedule")
    if stages_per_rank < 1:
        raise ConfigError("parallel.pipeline.stages_per_rank", stages_per_rank, "a positive integer")
    num_stages = pp * stages_per_rank
    if num_stages > num_units:
        raise ConfigError("parallel.pp", pp, f"pp x stages_per_rank = {num_stages} stages for a model of "
                          f"{num_units} pipeline units: at most one stage per unit")
    if microbatches < 1:
        raise ConfigError("parallel.pipeline.microbatches", microbatches, "a positive integer")
    if schedule == "1f1b" and microbatches < pp:
        raise ConfigError("parallel.pipeline.microbatches", microbatches, f"at least pp={pp} for the 1f1b schedule")
    if schedule == "zbv" and microbatches < num_stages:
        raise ConfigError("parallel.pipeline.microbatches", microbatches,
                          f"at least the number of stages ({num_stages}) for the zbv schedule")
    if schedule in ("interleaved_1f1b", "zero_bubble"):
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ConfigError("parallel.pipeline.microbatches", microbatches,
                              f"a multiple of max(1, microbatches // pp) = {rounds} for {schedule}, "
                              f"e.g. a multiple of pp={pp}")
    if batch_size % microbatches:
        raise ConfigError("parallel.pipeline.microbatches", microbatches,
                          f"a divisor of the batch size {batch_size}: microbatches must be equal in size")


class UnitStage(nn.Module):
    """Pipeline units of a model under the model's own names, applied in order by ``forward``.

    A unit ``blocks.3`` is held as child ``3`` of a ``ModuleDict`` named ``blocks``, so parameter names stay
    those of the full model. Shares the modules with the model (nothing is copied).
    """

    def __init__(self, model: nn.Module, units: Sequence[str]) -> None:
        super().__init__()
        for name in units:
            parent: nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                if part not in parent._modules:
                    parent.add_module(part, nn.ModuleDict())
                parent = parent._modules[part]
            parent.add_module(leaf, model.get_submodule(name))
        self.unit_names = list(units)
        # kept outside the module tree: what the model declares of its whole self (its attention heads)
        object.__setattr__(self, "_whole_model", model)

    def attention_heads(self) -> dict[str, HeadBlocks]:
        """The model's own declaration (``disttrain.models.heads``): its patterns are the units' names too."""
        declare = getattr(self._whole_model, "attention_heads", None)
        return declare() if callable(declare) else {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The units in turn: the first stage takes the model's input, the last returns its output."""
        for name in self.unit_names:
            x = self.get_submodule(name)(x)
        return x


def build_stage_module(model: nn.Module, units: Sequence[str], stage_index: int, points: Sequence[int]
                       ) -> UnitStage:
    """Stage ``stage_index`` of a model cut at ``points`` (from ``unit_split_points``) between ``units``.

    Shares the modules with ``model`` (nothing is copied): build each stage from its own model instance,
    or from one model per rank when the rank holds several stages (they own disjoint parts).
    """
    num_stages = len(points)
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index {stage_index} outside 0..{num_stages - 1}")
    end = points[stage_index + 1] if stage_index + 1 < num_stages else len(units)
    return UnitStage(model, units[points[stage_index]:end])


def build_stages(
    model_fn: Callable[[], nn.Module],
    rank: int,
    pp: int,
    stages_per_rank: int,
    schedule: str,
    device: torch.device,
    group=None,
    points: Sequence[int] | None = None,
) -> tuple[list[PipelineStage], list[UnitStage]]:
    """This rank's ``PipelineStage`` objects and their modules, in schedule order.

    ``model_fn`` builds a full model (the same initial weights on every rank, e.g. after a fixed seed);
    it is called once here. ``points`` default to the parameter-balanced ``unit_split_points``.
    """
    model = model_fn()
    units = pipeline_units_of(model)
    num_stages = pp * stages_per_rank
    if points is None:
        points = unit_split_points(model, units, num_stages)
    indices = stage_indices(rank, pp, stages_per_rank, placement(schedule))
    from torch.distributed.pipelining import PipelineStage

    modules = [build_stage_module(model, units, i, points).to(device) for i in indices]
    stages = [PipelineStage(m, i, num_stages, device, group=group) for m, i in zip(modules, indices, strict=True)]
    return stages, modules


def build_schedule(
    name: str,
    stages: Sequence[PipelineStage],
    microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
    scale_grads: bool = True,
):
    """The torch schedule ``name`` (one of ``SCHEDULES``) over this rank's ``stages``.

    ``loss_fn(output, target)`` should return the microbatch mean; with ``scale_grads=True`` the gradients
    then equal those of the full-batch mean loss (see the module docstring).
    """
    from torch.distributed.pipelining.schedules import get_schedule_class

    if name not in SCHEDULES:
        raise ConfigError("parallel.pipeline.schedule", name, f"one of {list(SCHEDULES)}")
    cls = get_schedule_class(SCHEDULES[name])
    if name in SINGLE_STAGE:
        if len(stages) != 1:
            raise ConfigError("parallel.pipeline.stages_per_rank", len(stages), f"1 for the {name} schedule")
        return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    return cls(list(stages), n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
