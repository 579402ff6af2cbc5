"""Pipeline bubble of each schedule, measured with stages of known duration, next to theory.

    python benchmarks/pipeline_bubble.py [--fwd-ms 40] [--steps 2] [--quick]

Every stage is a module whose forward sleeps and whose backward sleeps, split so that torch's zero-bubble
schedules can separate the two backward phases:

* the activation path ``h = Sleep(x + anchor)``: forward sleeps F, backward sleeps B_I (the input-gradient
  phase, action ``I``; in a full backward, action ``B``, it is part of ``B``);
* the weight path ``out = h + WeightSleep(weight)``: the backward of ``WeightSleep`` sleeps B_W and only
  produces the weight's gradient, so torch's input-only backward (``autograd.grad`` with respect to the
  stage input) skips it and the later weight-gradient action ``W`` runs it.

Times are per rank per microbatch: a rank holding ``v`` stages gives each ``F/v``, ``B_I/v``, ``B_W/v``, so
every schedule does the same work per rank. Note that torch runs nothing in the first stage's ``I`` action
(its input needs no gradient) and the whole backward in its ``W`` action.

Each stage's ``forward_one_chunk``, ``backward_one_chunk`` and ``backward_weight_one_chunk`` are timed by
disttrain's ``ActionRecorder`` (the recorder of ``parallel.pipeline.timeline=true``; wall clock, shared by
the processes of this machine). After a warm-up step with the sleeps off (shape inference), ``--steps``
timed steps are run and the fastest kept: ``step time`` is from a barrier to the last rank's end,
``idle = 1 - busy / step time`` per rank, and the table shows the mean over ranks.

Theory (equal stages, no communication cost), p ranks, m microbatches, v stages per rank:

* GPipe, 1F1B: ``(p-1) / (m + p - 1)``;
* interleaved 1F1B: ``(p-1) / (v m + p - 1)``;
* interleaved zero bubble (ZB-H1-like with W filling part of the bubble): bubble time
  ``(p-1)(F + B_I - B_W) / v``, so with F = B_I = B_W the fraction ``(p-1) / (p - 1 + 3 v m)``;
* ZBV: 0 in the ideal case F = B_I = B_W (the bound the schedule is designed for).

A second run uses real matrix work (MLP stages) instead of sleeps and is reported separately. A PNG timeline
of one step per rank is written to ``benchmarks/out/pipeline_timeline.png``. Prints a markdown table and,
last, a headline line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from disttrain.parallel.pipeline.split import build_schedule, placement, stage_indices  # noqa: E402
from disttrain.parallel.pipeline.timeline import (
    ActionRecorder,  # noqa: E402
    draw_pipeline_timeline,  # noqa: E402
)
from tests.dist_utils import run_on_ranks  # noqa: E402

OUT = Path(__file__).resolve().parent / "out"
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved_1f1b": 2, "zero_bubble": 2, "zbv": 2}
WIDTH = 8
_SCALE = [1.0]  # sleeps are multiplied by this; 0 during the warm-up step


def _sleep(seconds: float) -> None:
    if seconds * _SCALE[0] > 0:
        time.sleep(seconds * _SCALE[0])


class _Sleep(torch.autograd.Function):
    """Identity whose forward sleeps ``fwd_s`` and backward ``bwd_s``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
        ctx.bwd_s = bwd_s
        _sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _sleep(ctx.bwd_s)
        return grad.clone(), None, None


class _WeightSleep(torch.autograd.Function):
    """Identity on a weight whose backward (the weight gradient) sleeps ``bwd_s``."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, bwd_s: float) -> torch.Tensor:
        ctx.bwd_s = bwd_s
        return w.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        _sleep(ctx.bwd_s)
        return grad.clone(), None


class SleepStage(nn.Module):
    """A stage of known cost: forward F, input-gradient backward B_I, weight-gradient backward B_W (seconds)."""

    def __init__(self, f: float, bi: float, bw: float) -> None:
        super().__init__()
        self.f, self.bi, self.bw = f, bi, bw
        self.anchor = nn.Parameter(torch.zeros(1))  # makes the activation path differentiable on stage 0 too
        self.weight = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _Sleep.apply(x + self.anchor, self.f, self.bi)
        return h + _WeightSleep.apply(self.weight, self.bw)


class MLPStage(nn.Module):
    """Real matrix work: ``depth`` residual MLP layers of width ``width``."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width)) for _ in range(depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x


def _run_config(schedule: str, m: int, make_stage, steps: int, batch_per_mb: int = 2) -> dict:
    """One schedule on this rank: a warm-up step without sleeps, then ``steps`` timed steps; the fastest is
    kept (the same one on every rank, since the step time is all-reduced), which filters out load spikes from
    other processes on the machine."""
    from torch.distributed.pipelining import PipelineStage

    rank, pp = dist.get_rank(), dist.get_world_size()
    v = SCHEDULES[schedule]
    indices = stage_indices(rank, pp, v, placement(schedule))
    modules = [make_stage(v) for _ in indices]
    stages = [PipelineStage(mod, i, pp * v, torch.device("cpu")) for mod, i in zip(modules, indices, strict=True)]
    sched = build_schedule(schedule, stages, m, lambda out, tgt: out.pow(2).mean())
    x = torch.randn(m * batch_per_mb, WIDTH if isinstance(modules[0], SleepStage) else modules[0].width)
    _SCALE[0] = 0.0
    sched.step(x, target=torch.zeros_like(x))
    _SCALE[0] = 1.0
    recorder = ActionRecorder(stages)
    result: dict = {}
    for _ in range(steps):
        dist.barrier()
        t0 = recorder.clock()
        with recorder.recording():
            sched.step(x, target=torch.zeros_like(x))
        end = torch.tensor(recorder.clock() - t0, dtype=torch.float64)
        dist.all_reduce(end, op=dist.ReduceOp.MAX)
        busy = sum(a["end_s"] - a["start_s"] for a in recorder.actions)
        if not result or end.item() < result["step"]:
            result = {"step": end.item(), "busy": busy, "idle": 1 - busy / end.item(), "stages": indices,
                      "actions": [{**a, "start_s": a["start_s"] - t0, "end_s": a["end_s"] - t0}
                                  for a in recorder.actions]}
        for mod in modules:
            for p in mod.parameters():
                p.grad = None
    return result


def _sleep_sweep(pp: int, micro: list[int], f: float, bi: float, bw: float, steps: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for schedule, v in SCHEDULES.items():
        for m in micro:
            if (schedule == "1f1b" and m < pp) or (schedule == "zbv" and m < 2 * pp) or \
                    (schedule in ("interleaved_1f1b", "zero_bubble") and m % max(1, m // pp)):
                continue
            out[(schedule, m)] = _run_config(schedule, m, lambda v: SleepStage(f / v, bi / v, bw / v), steps)
    return out


def _mlp_sweep(pp: int, m: int, width: int, depth: int, steps: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for schedule in SCHEDULES:
        def make(v: int) -> MLPStage:
            torch.manual_seed(0)
            stage = MLPStage(width, depth // v)
            stage.width = width
            return stage

        out[(schedule, m)] = _run_config(schedule, m, make, steps, batch_per_mb=64)
    return out


def theory(schedule: str, p: int, m: int, v: int) -> float:
    """Ideal idle fraction (equal stages, F = B_I = B_W for the zero-bubble schedules)."""
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1)
    if schedule == "zero_bubble":
        return (p - 1) / (p - 1 + 3 * v * m)
    return 0.0


def _timeline(ranks: list[dict]) -> dict:
    """One config's per-rank results as a timeline for ``draw_pipeline_timeline``: the step is from the barrier
    to the last rank's end."""
    return {"step_s": max(r["step"] for r in ranks), "bubble_fraction": sum(r["idle"] for r in ranks) / len(ranks),
            "ranks": [{"stages": r["stages"], "actions": r["actions"]} for r in ranks]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fwd-ms", type=float, default=40.0, help="forward F per rank per microbatch")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per config (the fastest is reported)")
    parser.add_argument("--quick", action="store_true", help="pp=2 and m in (4, 8) only")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    f = bi = bw = args.fwd_ms / 1000
    micro = [4, 8] if args.quick else [4, 8, 16]
    started = time.monotonic()
    rows, timelines = [], {}
    for pp in (2,) if args.quick else (2, 4):
        per_rank = run_on_ranks(_sleep_sweep, pp, pp, micro, f, bi, bw, args.steps, timeout=600)
        for key in per_rank[0]:
            schedule, m = key
            ranks = [r[key] for r in per_rank]
            idle = sum(r["idle"] for r in ranks) / pp
            th = theory(schedule, pp, m, SCHEDULES[schedule])
            rows.append(("sleep", schedule, pp, m, ranks[0]["step"], idle, th))
            timelines[(schedule, pp, m)] = ranks
    mlp = run_on_ranks(_mlp_sweep, 2, 2, 8, 256, 8, args.steps, timeout=600)
    for key in mlp[0]:
        schedule, m = key
        ranks = [r[key] for r in mlp]
        idle = sum(r["idle"] for r in ranks) / 2
        rows.append(("mlp", schedule, 2, m, ranks[0]["step"], idle, theory(schedule, 2, m, SCHEDULES[schedule])))

    print(f"Stages of known duration: F = B_I = B_W = {args.fwd_ms:g} ms per rank per microbatch "
          f"(a full backward B = B_I + B_W); v = stages per rank; idle = mean over ranks of 1 - busy / step.")
    print()
    print("| work | schedule | pp | v | microbatches | step (s) | idle fraction | theory | measured - theory |")
    print("|---|---|---|---|---|---|---|---|---|")
    for work, schedule, pp, m, step, idle, th in rows:
        print(f"| {work} | {schedule} | {pp} | {SCHEDULES[schedule]} | {m} | {step:.3f} | {idle:.3f} | {th:.3f} "
              f"| {idle - th:+.3f} |")
    print()
    pp_plot, m_plot = (2, 4) if args.quick else (4, 8)
    panels = [(f"{s} pp={pp_plot} m={m_plot}", timelines[(s, pp_plot, m_plot)]) for s in SCHEDULES
              if (s, pp_plot, m_plot) in timelines]
    png = draw_pipeline_timeline([(title, _timeline(ranks)) for title, ranks in panels],
                                 OUT / "pipeline_timeline.png")
    print(f"timeline: {png or 'not drawn (no matplotlib)'} ({time.monotonic() - started:.0f} s in all)")
    one = next(r for r in rows if r[:4] == ("sleep", "1f1b", 2, 4))
    zb = next(r for r in rows if r[:4] == ("sleep", "zero_bubble", 2, 4))
    print(f"1F1B idle fraction vs theory: {one[5]:.2f} vs {one[6]:.2f} (pp=2, m=4); "
          f"interleaved zero bubble {zb[5]:.2f} (theory {zb[6]:.2f})")


if __name__ == "__main__":
    main()
