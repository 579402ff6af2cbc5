"""A dry run's compute held against the plan priced for the machine it runs on.

The plan of a run is priced for its profile (an H100, say); a dry run computes on this machine. To compare like
with like, the dry run prices the same layout again on a profile of this CPU measured after each of its timed
steps (``InterleavedCalibration``): matrix products at the rate this process reaches replaying the rank's own
products (``rank_matmuls``) on its threads, element-wise bandwidth and the overhead per operator by the planner's
calibration, briefly; the medians of those measurements. The rest (convolution rates, memory, links) is the stored
calibration's (``python -m disttrain.plan --calibrate``) or the planner's quick measurement's. Interleaved, the
steps and the measurements meet the same load, so the comparison holds on a shared machine whatever else runs.

What is left is the planner's own error: FLOPs it miscounts, element-wise work and per-operator costs it
misprices, hooks it does not model (FSDP2's, DDP's). ``COMPUTE_ERROR`` states it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from typing import Any

import torch

from disttrain.plan.devices import HardwareProfile
from disttrain.plan.layout import Layout
from disttrain.plan.rank_matmuls import MatmulRecorder, MatmulReplay

COMPUTE_ERROR = (0.8, 1.75)
"""The planner's stated compute error on a profile whose rates are this machine's: a rank's measured compute per
step is from 0.8 to 1.75 times the plan's, for the layouts whose machinery the plan prices (DDP, ZeRO-1/2/3, HSDP,
full checkpointing, accumulation, pipelines) with at least ``MATMUL_SHARE`` of the planned compute in matrix
products and at least ``MIN_TOKENS`` tokens per micro-batch. The error is mostly one-sided: what the plan leaves
out (FSDP2's and DDP's copies of parameters and gradients, their hooks) makes a step longer, not shorter."""
MATMUL_SHARE = 0.5
"""The least share of the planned compute in matrix products for which ``COMPUTE_ERROR`` is stated: below it,
per-operator costs rule a step (dispatch, autograd, hooks), which the plan prices from one calibration on tiny
blocks and which follow the machine's load."""
MIN_TOKENS = 512
"""The fewest tokens per micro-batch for which ``COMPUTE_ERROR`` is stated: FSDP2 copies every gathered parameter
and reduced gradient once more per micro-batch (and under the fake group fills every gather's output), work in
proportion to the parameters, which the plan does not price; the matrix products it rides beside grow with the
tokens."""
UNPRICED = {
    "tp": "tensor parallelism's DTensor dispatch per operator is not priced",
    "cp": "context parallelism's splitting and gathering per attention call is not priced",
    "ep": "expert parallelism's exchange of rows is not priced",
    "selective": "selective checkpointing's policy per operator is not priced",
}
"""Machinery of a layout whose per-operator costs the plan's compute leaves out, and so no stated error covers."""


def unstated_reason(layout: Layout, matmul_share: float, tokens_per_micro_batch: int) -> str | None:
    """Why ``COMPUTE_ERROR`` does not cover this rank (None: it does)."""
    for name, active in (("tp", layout.tp > 1), ("cp", layout.cp > 1), ("ep", layout.ep > 1),
                         ("selective", layout.activation_checkpoint == "selective")):
        if active:
            return UNPRICED[name]
    if matmul_share < MATMUL_SHARE:
        return (f"matrix products are {matmul_share:.0%} of the plan, under {MATMUL_SHARE:.0%}: per-operator costs "
                "rule the step")
    if tokens_per_micro_batch < MIN_TOKENS:
        return (f"{tokens_per_micro_batch} tokens per micro-batch, under {MIN_TOKENS}: FSDP2's and DDP's copies of "
                "parameters and gradients, which the plan does not price, weigh on few tokens")
    return None


@dataclass
class ComputeHere:
    """A dry run's compute priced on this machine."""

    profile: HardwareProfile
    """The profile of this CPU the plan was priced on."""
    matmul_flops_per_s: float
    """Matrix-multiply FLOP/s of this process (all its threads) at the rank's shapes: median of the replays."""
    threads: int
    """Threads the dry run computed with."""
    planned_s: float
    """The plan's compute per step of the rank on ``profile``."""
    matmul_share: float
    """Share of ``planned_s`` in matrix products (the replay's median time / ``planned_s``)."""
    replays: int
    """Replays the rate is the median of."""
    planned_flops: float
    """FLOPs per step the plan counts on the rank (matrix products, attention, a matrix optimiser's iteration)."""
    run_flops: float
    """FLOPs the rank ran in its recorded step (``rank_matmuls.MatmulRecorder.flops``)."""
    unstated: str | None
    """Why ``COMPUTE_ERROR`` does not cover this rank (``unstated_reason``); None: it does."""

    def within_error(self, measured_s: float) -> bool | None:
        """Whether ``measured_s`` is within ``COMPUTE_ERROR`` of the plan; None where the error is not stated."""
        if self.unstated is not None:
            return None
        low, high = COMPUTE_ERROR
        return low <= measured_s / self.planned_s <= high


def base_machine_profile() -> HardwareProfile:
    """This machine's profile: the stored calibration, else the planner's quick measurement (once per process)."""
    from disttrain.plan.hardware import resolve_profile

    return resolve_profile("machine")


CALIBRATION_SECONDS = 0.05
"""Seconds of each interleaved measurement of element-wise bandwidth and of the overhead per operator."""


class InterleavedCalibration:
    """This machine measured after each timed step of a dry run, under the load that step met: the rank's products
    (recorded by ``recorder`` in an untimed step) replayed, element-wise bandwidth and the overhead per operator
    (``calibrate.measure_memory_bandwidth`` and ``measure_op_overhead``, one core each)."""

    def __init__(self) -> None:
        self.recorder = MatmulRecorder()
        """Records the rank's products (the dry run's last counted step runs under it)."""
        self.replay: MatmulReplay | None = None
        """The replay of the recorded products (None before the first measurement)."""
        self.replay_s: list[float] = []
        """Wall time of each replay."""
        self.bandwidth: list[float] = []
        """Element-wise bytes per second per core, each measurement."""
        self.overhead: list[float] = []
        """Seconds per operator beyond its work, each measurement."""

    def __call__(self) -> None:
        from disttrain.plan.calibrate import measure_memory_bandwidth, measure_op_overhead

        if self.replay is None:
            self.replay = MatmulReplay(self.recorder.calls)
        seconds = self.replay.seconds()
        self.replay_s.append(seconds)
        bandwidth = measure_memory_bandwidth(CALIBRATION_SECONDS)
        self.bandwidth.append(bandwidth)
        per_core = self.replay.flops / seconds / torch.get_num_threads() if seconds > 0 else float("inf")
        self.overhead.append(measure_op_overhead(CALIBRATION_SECONDS, per_core, bandwidth))


def profile_now(base: HardwareProfile, flops_per_s: float, bandwidth: float, overhead: float, dtype: str,
                threads: int, world: int) -> HardwareProfile:
    """``base`` with matrix products at ``flops_per_s`` on ``threads`` threads in ``dtype`` (``fp32``, ``bf16``),
    ``bandwidth`` bytes per second per core, ``overhead`` seconds per operator, and as many cores as give each of
    ``world`` ranks ``threads`` of them (a dry run's one rank has this process's threads; a plan's CPU ranks would
    share them)."""
    from disttrain.plan.calibrate import cpu_model

    flops = {**base.flops, dtype: flops_per_s / threads}
    return replace(base, name=f"this CPU ({cpu_model()}, {threads} thread{'s' if threads > 1 else ''})", flops=flops,
                   memory_bandwidth=bandwidth, op_overhead=overhead, devices_per_node=threads * world,
                   source=f"{base.source}; matrix products at the rank's own shapes, element-wise bandwidth and "
                          "overhead per operator, measured between the dry run's steps")


def planned_flops(inputs: Any, layout: Layout, threads: int) -> float:
    """FLOPs per step the plan counts on the rank of ``layout``: its compute time on a profile that computes one
    FLOP per second on the rank's ``threads``, moves bytes in no time and costs nothing per operator."""
    flops = {dtype: 1.0 / threads for dtype in inputs.profile.flops}
    counting = replace(inputs.profile, flops=flops, memory_bandwidth=float("inf"), op_overhead=0.0)
    return replace(inputs, profile=counting, _cache=inputs._cache).estimate(layout).compute_s


def matmul_dtype(run: Any, profile: HardwareProfile) -> str:
    """The dtype of the run's products on ``profile``: ``bf16`` under a bf16 precision, else ``fp32``."""
    from disttrain.plan.planner import planned_precision

    return "bf16" if planned_precision(run.train.trainer.precision, profile).startswith("bf16") else "fp32"


def cpu_plan_inputs(run: Any, profile: HardwareProfile) -> Any:
    """``run``'s model measured for a plan on ``profile`` (a CPU: its precision and autocast lists)."""
    from disttrain.parallel.model_checks import model_on_meta
    from disttrain.plan.planner import plan_inputs, planned_precision

    cfg = run.train
    return plan_inputs(model_on_meta(run.model, run.datamodule.spec), run.datamodule.spec, run.batch.micro_size,
                       cfg.parallel, run.optim, planned_precision(cfg.trainer.precision, profile), profile)


def compute_here(run: Any, layout: Layout, calibration: InterleavedCalibration, base: HardwareProfile) -> ComputeHere:
    """The plan of ``run``'s ``layout`` priced on this CPU as ``calibration`` measured it (the medians of its
    measurements) on this process's threads, and the FLOPs the rank's recorded step ran."""
    threads = torch.get_num_threads()
    median = statistics.median(calibration.replay_s)
    rate = calibration.replay.flops / median if median > 0 else float("inf")
    profile = profile_now(base, rate, statistics.median(calibration.bandwidth), statistics.median(calibration.overhead),
                          matmul_dtype(run, base), threads, layout.world_size)
    inputs = cpu_plan_inputs(run, profile)
    planned = inputs.estimate(layout).compute_s
    share = median / planned if planned else 0.0
    tokens = layout.micro_size * inputs.stats.tokens_per_sample
    return ComputeHere(profile, rate, threads, planned, share, len(calibration.replay_s),
                       planned_flops(inputs, layout, threads), calibration.recorder.flops,
                       unstated_reason(layout, share, tokens))
