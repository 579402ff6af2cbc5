"""Pipeline parallelism for the GPT with ``torch.distributed.pipelining`` (plain functions, no Lightning).

The model's transformer ``blocks`` are cut into ``pp * stages_per_rank`` contiguous stages. Each rank builds
the stage modules it owns from a full model by deleting what it does not own, so parameter names stay those
of the full model (``blocks.3.attn.q.weight``) and a stage's state dict is a slice of the full one:

* the first stage keeps ``wte``, ``wpe`` and ``drop`` and takes token ids ``[B, T]``;
* the last stage keeps ``ln_f`` and ``lm_head`` and returns logits ``[B, T, vocab]``;
* every other stage maps hidden states ``[B, T, C]`` to hidden states.

Placement: rank ``r`` holds stages ``r, r + pp, r + 2 pp, ...`` ("loop"), which serves GPipe, 1F1B,
interleaved 1F1B and interleaved zero bubble with one code path; ZBV needs the "v" placement, rank ``r``
holding stages ``r`` and ``2 pp - 1 - r`` (see ``stage_indices``).

Weight tying: the LM head's weight on the last stage cannot share storage with the token embedding on the
first stage without extra communication, so a tied model is refused with pp > 1 (``check_pipeline`` and
``build_stage_module`` raise ``ConfigError``); set ``model.tie_weights=false``.

Loss scaling: with ``scale_grads=True`` torch's schedules divide every stage's gradients by the number of
microbatches after the step. With a ``loss_fn`` that returns the microbatch *mean* cross-entropy, the
gradient is ``(1/m) sum_i grad(mean over microbatch i)``, which for equal-sized microbatches is the gradient
of the mean over the whole batch: the same objective (and gradient) as one process with the full batch.
``tests/test_pipeline_apply.py`` pins this for every schedule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from disttrain.errors import ConfigError

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
    num_blocks: int,
    stages: int,
    param_counts: Sequence[int] | None = None,
    explicit: Sequence[int] | None = None,
    embed_params: int = 0,
    head_params: int = 0,
) -> list[int]:
    """The block index at which each of ``stages`` contiguous stages starts (the first is always 0).

    ``explicit``: the start blocks of stages 1..stages-1 (a leading 0 may be given too), checked and returned.
    Otherwise the cut minimises the largest stage cost, a stage's cost being the sum of its blocks'
    ``param_counts`` (every block 1 when None), plus ``embed_params`` on the first stage and ``head_params``
    on the last. Ties go to the earliest cut. ``ConfigError`` for more stages than blocks or bad points.
    """
    if stages < 1:
        raise ConfigError("parallel.pp", stages, "a positive number of pipeline stages")
    if stages > num_blocks:
        raise ConfigError("parallel.pp", stages,
                          f"at most {num_blocks} stages (pp x stages_per_rank): the model has {num_blocks} blocks")
    if explicit is not None:
        points = [int(p) for p in explicit]
        if len(points) == stages - 1:
            points = [0, *points]
        ok = (len(points) == stages and points[0] == 0 and all(a < b for a, b in zip(points, points[1:], strict=False))
              and points[-1] < num_blocks)
        if not ok:
            raise ConfigError("parallel.pipeline_split_points", list(explicit),
                              f"{stages - 1} strictly increasing block indices in 1..{num_blocks - 1}")
        return points
    costs = [1] * num_blocks if param_counts is None else [int(c) for c in param_counts]
    if len(costs) != num_blocks:
        raise ValueError(f"param_counts has {len(costs)} entries for {num_blocks} blocks")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(start: int, end: int, first: bool, last: bool) -> int:
        return prefix[end] - prefix[start] + (embed_params if first else 0) + (head_params if last else 0)

    # best[s][j]: (largest stage cost, start points) for blocks 0..j-1 cut into s stages.
    inf = float("inf")
    best: list[list[tuple[float, list[int]]]] = [[(inf, [])] * (num_blocks + 1) for _ in range(stages + 1)]
    best[0][0] = (0, [])
    for s in range(1, stages + 1):
        last = s == stages
        for j in range(s, num_blocks - (stages - s) + 1):
            if last and j != num_blocks:
                continue
            for i in range(s - 1, j):
                prev, starts = best[s - 1][i]
                if prev == inf:
                    continue
                value = max(prev, cost(i, j, s == 1, last))
                if value < best[s][j][0]:
                    best[s][j] = (value, [*starts, i])
    return best[stages][num_blocks][1]


def gpt_split_points(model: nn.Module, num_stages: int, explicit: Sequence[int] | None = None) -> list[int]:
    """``split_points`` for a GPT, balanced by parameter count (embeddings first stage, ln_f + head last)."""
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    embed = model.wte.weight.numel() + model.wpe.weight.numel()
    head = sum(p.numel() for p in model.ln_f.parameters()) + model.lm_head.weight.numel()
    return split_points(len(blocks), num_stages, blocks, explicit, embed_params=embed, head_params=head)


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
    num_blocks: int,
    tie_weights: bool = False,
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
    if num_stages > num_blocks:
        raise ConfigError("parallel.pp", pp, f"pp x stages_per_rank = {num_stages} stages for a model of "
                          f"{num_blocks} blocks: at most one stage per block")
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
    if tie_weights and pp > 1:
        raise ConfigError("model.tie_weights", tie_weights,
                          "false with pipeline parallelism: the embedding and the LM head live on different "
                          "stages")


class GPTStage(nn.Module):
    """The part of a GPT that one pipeline stage owns, under the full model's parameter names.

    ``blocks`` is an ``nn.ModuleDict`` keyed by the original block index, so ``blocks.3.attn.q.weight`` keeps
    its name; ``wte``/``wpe``/``drop`` are None except on the first stage, ``ln_f``/``lm_head`` None except
    on the last.
    """

    def __init__(self, model: nn.Module, owned: range, first: bool, last: bool) -> None:
        super().__init__()
        self.block_size = model.dims.block_size
        self.wte = model.wte if first else None
        self.wpe = model.wpe if first else None
        self.drop = model.drop if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in owned})
        self.ln_f = model.ln_f if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids ``[B, T]`` (first stage) or hidden ``[B, T, C]`` to hidden or logits (last stage)."""
        if self.wte is not None:
            t = x.size(1)
            if t > self.block_size:
                raise ValueError(f"sequence length {t} exceeds the model's block_size {self.block_size}")
            x = self.drop(self.wte(x) + self.wpe(torch.arange(t, device=x.device)))
        for block in self.blocks.values():
            x = block(x)
        if self.lm_head is not None:
            x = self.lm_head(self.ln_f(x))
        return x


class CNNStage(nn.Module):
    """The part of a CNN that one pipeline stage owns: the stem on the first, residual blocks (keyed by their
    original index, so names stay those of the full model), the head on the last."""

    def __init__(self, model: nn.Module, owned: range, first: bool, last: bool) -> None:
        super().__init__()
        self.stem = model.stem if first else None
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in owned})
        self.head = model.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Images (first stage) or feature maps to feature maps or class logits (last stage)."""
        if self.stem is not None:
            x = self.stem(x)
        for block in self.blocks.values():
            x = block(x)
        return self.head(x) if self.head is not None else x


def cnn_split_points(model: nn.Module, num_stages: int, explicit: Sequence[int] | None = None) -> list[int]:
    """Block index where each pipeline stage starts, cut only between the CNN's own stages (where the
    width changes), balanced by parameter count (stem on the first stage, head on the last)."""
    if explicit:
        return split_points(len(model.blocks), num_stages, explicit=explicit)
    per = model.blocks_per_stage
    units = [sum(p.numel() for b in model.blocks[u * per:(u + 1) * per] for p in b.parameters())
             for u in range(model.num_stages)]
    stem = sum(p.numel() for p in model.stem.parameters())
    head = sum(p.numel() for p in model.head.parameters())
    return [u * per for u in split_points(len(units), num_stages, units, None, embed_params=stem, head_params=head)]


def model_split_points(model: nn.Module, num_stages: int, explicit: Sequence[int] | None = None) -> list[int]:
    """Split points of a GPT (between any blocks) or a CNN (between its stages)."""
    if hasattr(model, "stem"):
        return cnn_split_points(model, num_stages, explicit)
    return gpt_split_points(model, num_stages, explicit)


def build_stage_module(model: nn.Module, stage_index: int, num_stages: int, points: Sequence[int]) -> nn.Module:
    """Stage ``stage_index`` of ``num_stages`` of a GPT cut at ``points`` (from ``split_points``).

    Shares the modules with ``model`` (nothing is copied): build each stage from its own model instance,
    or from one model per rank when the rank holds several stages (they own disjoint parts).
    """
    if len(points) != num_stages:
        raise ValueError(f"{len(points)} split points for {num_stages} stages")
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index {stage_index} outside 0..{num_stages - 1}")
    if num_stages > 1 and getattr(model, "tied", False):
        raise ConfigError("model.tie_weights", True, "false with pipeline parallelism: the embedding and the "
                          "LM head live on different stages")
    end = points[stage_index + 1] if stage_index + 1 < num_stages else len(model.blocks)
    stage_cls = CNNStage if hasattr(model, "stem") else GPTStage
    return stage_cls(model, range(points[stage_index], end), stage_index == 0, stage_index == num_stages - 1)


def build_stages(
    model_fn: Callable[[], nn.Module],
    rank: int,
    pp: int,
    stages_per_rank: int,
    schedule: str,
    device: torch.device,
    group=None,
    points: Sequence[int] | None = None,
) -> tuple[list[PipelineStage], list[GPTStage]]:
    """This rank's ``PipelineStage`` objects and their modules, in schedule order.

    ``model_fn`` builds a full model (the same initial weights on every rank, e.g. after a fixed seed);
    it is called once here. ``points`` default to the parameter-balanced ``gpt_split_points``.
    """
    model = model_fn()
    num_stages = pp * stages_per_rank
    if points is None:
        points = gpt_split_points(model, num_stages)
    indices = stage_indices(rank, pp, stages_per_rank, placement(schedule))
    modules = [build_stage_module(model, i, num_stages, points).to(device) for i in indices]
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
    if name not in SCHEDULES:
        raise ConfigError("parallel.pipeline.schedule", name, f"one of {list(SCHEDULES)}")
    cls = get_schedule_class(SCHEDULES[name])
    if name in SINGLE_STAGE:
        if len(stages) != 1:
            raise ConfigError("parallel.pipeline.stages_per_rank", len(stages), f"1 for the {name} schedule")
        return cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
    return cls(list(stages), n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=scale_grads)
