"""``mode=dryrun``: one rank of any layout built and stepped in this process, and held against the plan.

torch's fake process group (``backend="fake"``) returns every collective at once, its output filled from this
rank's own input (as if every rank held what this one does: an all-to-all of expert counts sees balanced routing), so
this process can be rank r of a world of N: the real DeviceMesh over N ranks, the model built on the meta device
and laid out by the path a training rank takes (``disttrain.parallel.lay_out``: FSDP2 allocates only this rank's
shards), data of the real shapes and a few real steps (forward, backward, the optimiser, the checkpointing policy).
The values of a dry run mean nothing; the sizes and lifetimes of its tensors are real. Communication is absent by
construction.

Memory is the framework's tensor-byte counter (``disttrain.observe.tensor_bytes.LiveStorages``, the one the planner's
measurements use), from the laid-out model's state to the end of the last step; on a GPU (the rank runs on
``cuda:0``, whatever the layout's world size) also the CUDA allocator's ``max_memory_allocated`` and
``max_memory_reserved`` over the model's layout and every step.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from disttrain.errors import ConfigError
from disttrain.plan.dry_compute import (
    COMPUTE_ERROR,
    ComputeHere,
    InterleavedCalibration,
    base_machine_profile,
    compute_here,
)
from disttrain.plan.dry_device import GIB, allocator_peaks, memory_available, rank_device, start_peaks
from disttrain.plan.dry_steps import PIPELINE_SCHEDULES, StepMemory, run_steps
from disttrain.plan.estimate import Estimate
from disttrain.plan.layout import Layout
from disttrain.plan.pictures import write_dry_run_pictures
from disttrain.plan.units import human_bytes

RESULT_FILE = "dryrun.json"
"""What a dry run writes into the run directory."""


def default_rank(layout: Layout) -> int:
    """The rank the plan names as the busiest: the first rank of the first pipeline stage (it holds the most
    microbatches in flight; the plan's activations are that stage's). Without a pipeline every rank holds the same
    share, and the first stands for them all."""
    return 0


def check_runs_here(est: Estimate, whole_model_bytes: float, rank: int, available: int,
                    where: str = "available on this machine") -> None:
    """Refuse a rank the device it would run on cannot hold: its planned peak, or the whole model a layout without
    FSDP2 allocates before cutting or replicating it, beyond ``available`` bytes (``where``: where they were read,
    ``dry_device.memory_available``)."""
    need = max(est.total_bytes, whole_model_bytes)
    if need <= available:
        return
    what = (f"the plan puts rank {rank}'s peak at {human_bytes(est.total_bytes)}" +
            (f" and its layout allocates the whole model ({human_bytes(whole_model_bytes)}) before laying it out"
             if whole_model_bytes > est.total_bytes else ""))
    raise ConfigError("mode", "dryrun", f"a layout whose one rank fits this machine: {what}, and "
                      f"{human_bytes(available)} is {where} (mode=plan prints the plan without running it)")


def dry_run(run: Any) -> dict[str, Any]:
    """``mode=dryrun`` on a validated run: build ``dryrun.rank`` (default: ``default_rank``) of its layout under a
    fake process group, run ``dryrun.steps`` steps, print measured against planned memory and compute time, write
    ``dryrun.json`` into the run directory (with ``plots``, the plan's memory and the measured moments beside it in
    ``plots/``); return what it wrote."""
    from disttrain.plan.planner import plan_of_run

    cfg = run.train
    est, profile, inputs = plan_of_run(run)
    layout = est.layout
    world = layout.world_size
    rank = cfg.dryrun.rank if cfg.dryrun.rank is not None else default_rank(layout)
    if not 0 <= rank < world:
        raise ConfigError("dryrun.rank", rank, f"a rank of this layout's {world}: 0 to {world - 1}, or null for "
                          "the busiest")
    if layout.pp > 1 and (layout.schedule not in PIPELINE_SCHEDULES or layout.stages_per_rank > 1):
        raise ConfigError("parallel.pipeline.schedule", layout.schedule, f"one of {list(PIPELINE_SCHEDULES)} with "
                          "mode=dryrun (torch's schedules cannot run under a fake process group; a dry run replays "
                          "a one-stage-per-rank schedule itself)")
    if run.plan.kind not in ("synchronous", "pipelined"):
        raise ConfigError("mode", "dryrun", f"a synchronous or pipelined run (this one is {run.plan.kind}: its "
                          "exchanges are not DDP's or FSDP2's, which a dry run builds)")
    whole = 0.0 if layout.wrapper == "fsdp" else inputs.stats.params * 4
    # one rank, on one device whatever the world size: its memory is what the rank is held against
    device = rank_device(cfg.trainer.accelerator)
    check_runs_here(est, whole, rank, *memory_available(device))
    # on a CPU this machine is measured after each timed step (the rank's own products, recorded in an untimed
    # step, replayed; bandwidth; overhead per operator): the plan priced on it is held against the steps. A GPU
    # is not priced so: its step is printed beside the plan on the named profile
    calibration = InterleavedCalibration() if device.type == "cpu" else None
    measured, _ = _run_rank(run, layout, rank, device, calibration)
    here = None
    if calibration is not None and calibration.replay_s:
        here = compute_here(run, layout, calibration, base_machine_profile())
    result = _result(est, profile, layout, rank, measured, device, here)
    print(render_dry_run(result, run.model.name), flush=True)
    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / RESULT_FILE
    path.write_text(json.dumps(result, indent=2))
    pictures = write_dry_run_pictures(est, result, run_dir / "plots") if cfg.plots else []
    for written in [path, *pictures]:
        print(f"wrote {written}", flush=True)
    return result


def _run_rank(run: Any, layout: Layout, rank: int, device: torch.device,
              calibration: InterleavedCalibration | None = None) -> tuple[StepMemory, int]:
    """Join a fake group as ``rank``, lay the model out as that rank does and run its steps (with
    ``calibration``: its matrix products recorded in the last counted step, the machine measured after each timed
    one)."""
    from functools import partial

    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from disttrain.data.spec import example_batch
    from disttrain.models.nf4 import quantise_adapted_bases
    from disttrain.optim import build_optimizer
    from disttrain.parallel.context import sequence_split_of
    from disttrain.parallel.dims import MESH_DIM_NAMES
    from disttrain.parallel.lay_out import lay_out
    from disttrain.parallel.model_checks import model_on_meta
    from disttrain.parallel.pipeline.runtime import PipelineSlot, scaled_cross_entropy
    from disttrain.parallel.zero1 import shard_optimizer_state

    if dist.is_initialized():
        raise ConfigError("mode", "dryrun", "a process without a process group (this one has joined one already)")
    cfg, spec = run.train, run.datamodule.spec
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world_size)
    try:
        torch.manual_seed(cfg.seed)
        start_peaks(device)  # before the mesh: it would otherwise pick a GPU by the rank's number
        mesh = init_device_mesh(device.type, layout.mesh_shape, mesh_dim_names=MESH_DIM_NAMES)
        split = sequence_split_of(mesh) if layout.cp_enabled else None
        net = model_on_meta(run.model, spec)
        slot = None
        if layout.pp > 1:
            plan = run.plan
            example = torch.zeros(plan.microbatch_shape, dtype=getattr(torch, plan.microbatch_dtype))
            slot = PipelineSlot(partial(scaled_cross_entropy, divisor=plan.loss_divisor), example)
        laid_out = lay_out(net, mesh, layout, cfg.parallel, device, _materializer(net), split, slot,
                           cfg.trainer.float8, precision=cfg.trainer.precision)
        quantise_adapted_bases(laid_out)  # QLoRA's base, as the strategy quantises it once laid out
        if isinstance(laid_out, DistributedDataParallel):
            laid_out.register_comm_hook(None, _unsent)
        optimizer = build_optimizer(run.optim, laid_out)
        if layout.shards_only_optimizer_state:  # ZeRO-1, as the synchronous kind wraps it
            optimizer = shard_optimizer_state(optimizer, mesh["dp_shard"].get_group())
        batch = tuple(part.to(device) for part in example_batch(spec, layout.micro_size))
        if split is not None:
            batch = tuple(split.split(part) for part in batch)
        autocast = cfg.trainer.precision == "bf16-mixed"
        pp_rank = mesh.get_local_rank("pp")
        measured = run_steps(laid_out, optimizer, batch, layout, cfg.dryrun.steps, autocast, slot, pp_rank,
                             calibration.recorder if calibration is not None else None, calibration)
        measured.allocator_peaks = allocator_peaks(device)
        return measured, pp_rank
    finally:
        dist.destroy_process_group()


def _unsent(_, bucket):  # unannotated: DDP compares annotations with classes, which postponed ones are not
    """DDP's exchange of a gradient bucket under a fake group: the bucket as it is (DDP's own all-reduce hook
    expects a result a fake collective does not give)."""
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def _materializer(net: nn.Module) -> Any:
    """How a dry run allocates ``net`` from the meta device: the model's own ``materialize`` where it has one
    (buffers no checkpoint holds), else empty storage; then small random weights in every local shard (finite
    values keep the arithmetic at its usual speed; a dry run's values mean nothing else)."""
    own = getattr(net, "materialize", None)

    def materialize(device: torch.device) -> None:
        if own is not None:
            own(device)
        else:
            net.to_empty(device=device)
        with torch.no_grad():
            for param in net.parameters():
                (param.to_local() if hasattr(param, "to_local") else param).normal_(0.0, 0.02)

    return materialize


def _result(est: Estimate, profile: Any, layout: Layout, rank: int, measured: StepMemory,
            device: torch.device, here: ComputeHere | None) -> dict[str, Any]:
    """``dryrun.json``'s content (``here``: the plan priced on this CPU, None on a GPU or without timed steps)."""
    step_s = statistics.median(measured.step_s)
    fits = measured.peak <= est.capacity
    compute_here_fields: dict[str, Any] = {"planned_compute_s": None, "compute_ratio": None}
    if here is not None:
        compute_here_fields = {
            "planned_compute_s": here.planned_s, "compute_ratio": step_s / here.planned_s if here.planned_s else None,
            "compute_profile": here.profile.name, "compute_profile_source": here.profile.source,
            "threads": here.threads, "matmul_flops_per_s": here.matmul_flops_per_s, "matmul_replays": here.replays,
            "matmul_share": here.matmul_share, "compute_error": list(COMPUTE_ERROR), "compute_unstated": here.unstated,
            "planned_flops": here.planned_flops, "run_flops": here.run_flops,
            "compute_within_error": here.within_error(step_s)}
    return {"rank": rank, "world_size": layout.world_size, "layout": layout.describe(), "device": str(device),
            "measured_peak_bytes": measured.peak, "planned_peak_bytes": est.total_bytes,
            "peak_ratio": measured.peak / est.total_bytes if est.total_bytes else None,
            "measured_moments_bytes": measured.moments, "planned_moments_bytes": est.phases,
            "allocator_peak_bytes": measured.allocator_peaks,
            "allocator_peak_gib": {name: value / GIB for name, value in measured.allocator_peaks.items()},
            "planned_memory_bytes": est.memory,
            "measured_step_s": step_s, "measured_steps_s": measured.step_s,
            "steps_under_counter": measured.counted_only, **compute_here_fields,
            "planned_compute_s_on_profile": est.compute_s,
            "capacity_bytes": est.capacity, "fits": fits, "profile": profile.name,
            "communication": "absent by construction (fake process group: collectives return at once)"}


def compute_lines(result: dict[str, Any]) -> list[str]:
    """The dry run's compute as text: measured against the plan priced on this machine, with the planner's stated
    error, the FLOPs both count, then the plan on the named profile."""
    measured = f"{result['measured_step_s'] * 1e3:.3g} ms"
    named = (f"compute per step planned on {result['profile']}: {result['planned_compute_s_on_profile'] * 1e3:.3g} "
             f"ms; communication: {result['communication']}")
    if result["steps_under_counter"]:
        return [f"compute per step: measured {measured} under the byte counter, which slows every operator "
                "(dryrun.steps=3 or more times a step outside it)", named]
    if result["planned_compute_s"] is None:
        return [f"compute per step: measured {measured} on {result['device']}", named]
    low, high = result["compute_error"]
    verdict = {True: "within it", False: "OUTSIDE it",
               None: f"not stated here: {result['compute_unstated']}"}[result["compute_within_error"]]
    run_flops, planned_flops = result["run_flops"], result["planned_flops"]
    return [f"compute per step: measured {measured}, planned {result['planned_compute_s'] * 1e3:.3g} ms on "
            f"{result['compute_profile']}, matrix products at {result['matmul_flops_per_s'] / 1e9:.3g} GFLOP/s (this "
            f"rank's own, median of {result['matmul_replays']} replays between its steps); measured / planned "
            f"{result['compute_ratio']:.2f}, the planner's stated compute error {low} to {high}: {verdict}",
            f"FLOPs per step: this rank ran {run_flops / 1e9:.4g} G, the plan counts {planned_flops / 1e9:.4g} G"
            + (f" (plan / run {planned_flops / run_flops:.3f})" if run_flops else ""),
            named]


def allocator_lines(result: dict[str, Any]) -> list[str]:
    """A GPU rank's allocator peaks in GiB beside the plan's peak (none on a CPU)."""
    peaks = result.get("allocator_peak_bytes") or {}
    if not peaks:
        return []
    planned = result["planned_peak_bytes"]
    return [f"CUDA allocator on {result['device']}: max_memory_allocated {peaks['max_memory_allocated'] / GIB:.2f} "
            f"GiB, max_memory_reserved {peaks['max_memory_reserved'] / GIB:.2f} GiB (torchtitan's published memory is "
            f"this reserved peak), planned peak {planned / GIB:.2f} GiB (reserved / planned "
            f"{peaks['max_memory_reserved'] / planned:.3f})"]


def render_dry_run(result: dict[str, Any], model: str) -> str:
    """The dry run as text: measured against planned peak memory, its moments, step time and whether it fits."""
    measured, planned = result["measured_peak_bytes"], result["planned_peak_bytes"]
    lines = [f"dry run: {model}, rank {result['rank']} of {result['world_size']} ({result['layout']}) on "
             f"{result['device']}",
             f"peak memory: measured {human_bytes(measured)}, planned {human_bytes(planned)} "
             f"(measured / planned {result['peak_ratio']:.3f})"]
    moments = result["measured_moments_bytes"]
    lines.append("measured moments: " + ", ".join(f"{name.replace('_', ' ')} {human_bytes(value)}"
                                                  for name, value in moments.items()))
    lines.append("planned moments: " + ", ".join(f"{name.replace('_', ' ')} {human_bytes(value)}"
                                                 for name, value in result["planned_moments_bytes"].items()))
    lines += allocator_lines(result)
    lines += compute_lines(result)
    verdict = "fits" if result["fits"] else "DOES NOT FIT"
    lines.append(f"{verdict} the profile's {human_bytes(result['capacity_bytes'])} per rank")
    return "\n".join(lines)
