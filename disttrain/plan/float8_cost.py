"""What ``trainer.fp8`` changes in a plan: the swapped layers' matrix products at the profile's float8 rate, the
casts that feed them, and, where FSDP2 gathers their weights in float8, one byte per gathered value.

torchao's ``Float8Linear`` (tensorwise and rowwise recipes alike) runs all three products of a layer in float8:
the output, the input's gradient and the weight's gradient. It saves for backward what ``nn.Linear`` saves (the
input in the run's precision and the weight as the layer holds it), and casts again in backward: each of input,
weight and output gradient is cast once for each of the two products it enters. A cast reads its tensor twice
(the amax reduction, then the scaled cast) and writes one byte per value. Under autocast a float8 layer makes no
bf16 copy of its weight (it casts the fp32 weight straight to float8): the autocast weight copies the pass saw of
those layers are not made. With float8 gathers (tensorwise under ZeRO-2/3 and HSDP) FSDP2 casts each rank's shard
before the gather, once per gather, and the gathered weight is float8: one byte per value in the gather's traffic
and buffers.

A profile without a float8 rate (a CPU, whose calibration measures fp32 and bf16 only) prices the products at the
run's own rate; the casts are charged there too.
"""

from __future__ import annotations

from dataclasses import dataclass

from disttrain.parallel.float8 import Float8Layers
from disttrain.plan.devices import HardwareProfile
from disttrain.plan.layout import Layout, policy_of_units, unit_on_rank, within
from disttrain.plan.model_stats import ModelStats

FLOAT8_BYTES = 1
"""Bytes of one float8 value."""
PRODUCTS = 3
"""Matrix products per float8 layer per pass: the output, the input's gradient, the weight's gradient."""
CASTS_PER_TENSOR = 2
"""Casts of each of input, weight and output gradient per pass (once per product it enters)."""


@dataclass(frozen=True)
class Float8Cost:
    """A plan's float8 terms for the busiest rank of one layout."""

    products_saved_s: float
    """Seconds per step the float8 products save against the same products at the run's rate."""
    casts_s: float
    """Seconds per step the casts to float8 take (amax reductions, scaled casts)."""
    gathered_elements: float
    """Float8 weight elements of the rank before data-parallel sharding that FSDP2 gathers in float8 (0: none)."""
    priced_at: str
    """The rate the products are priced at: ``fp8``, or the run's dtype where the profile has no float8 rate."""

    @property
    def seconds(self) -> float:
        """What float8 adds to a step's compute time (negative: it saves)."""
        return self.casts_s - self.products_saved_s


def weight_shapes(stats: ModelStats, float8: Float8Layers) -> dict[str, tuple[int, int]]:
    """``(out_features, in_features)`` of each float8 layer's weight, by parameter name."""
    shapes = {}
    for module in float8.modules:
        name = f"{module}.weight"
        rows = stats.param_rows.get(name)
        if name in stats.param_numel and rows:
            shapes[name] = (rows, stats.param_numel[name] // rows)
    return shapes


def gathered_in_float8(stats: ModelStats, layout: Layout, float8: Float8Layers | None) -> set[str]:
    """Parameter names FSDP2 gathers in float8 under ``layout`` (empty where it gathers none)."""
    if float8 is None or not float8.all_gather or not layout.shards_parameters:
        return set()
    return set(weight_shapes(stats, float8))


def float8_cost(stats: ModelStats, layout: Layout, units: list[str] | None, profile: HardwareProfile,
                float8: Float8Layers, dtype: str, hp_bytes: float, threads: float) -> Float8Cost:
    """The float8 terms of the rank holding ``units`` (None: all): ``dtype`` the run's compute dtype (``bf16``,
    ``fp32``) whose rate the measured pass priced these products at, ``hp_bytes`` the bytes per value the casts
    read, ``threads`` the cores of a CPU rank (1 on a GPU)."""
    run_rate = profile.flops[dtype] * threads
    priced_at = "fp8" if "fp8" in profile.flops else dtype
    fp8_rate = profile.flops.get("fp8", profile.flops[dtype]) * threads
    bandwidth = profile.memory_bandwidth * threads
    policies = policy_of_units(stats.shard_units, layout.activation_checkpoint, layout.checkpoint_every_n_blocks)
    pipelined = layout.pp > 1
    tokens = layout.micro_size / (layout.microbatches if pipelined else 1) * stats.tokens_per_sample / layout.cp
    passes = layout.accumulation * (layout.microbatches if pipelined else 1)
    gathered = gathered_in_float8(stats, layout, float8)

    def casts_s(values: float, count: float) -> float:
        """``count`` casts of ``values`` values each: the amax reduction reads them, the scaled cast reads them
        and writes one byte each; each operator at least the profile's overhead (on a GPU the launch overlaps
        the kernels before it, on a CPU it comes on top)."""
        work = (values * hp_bytes / bandwidth, values * (hp_bytes + FLOAT8_BYTES) / bandwidth)
        per_op = [max(w, profile.op_overhead) if not profile.cpu else w + profile.op_overhead for w in work]
        return count * sum(per_op)

    flops = cast_s = 0.0
    mine = 0.0
    for name, (rows, cols) in weight_shapes(stats, float8).items():
        unit = stats.param_unit[name]
        if not unit_on_rank(stats, unit, units):
            continue
        # tensor parallelism splits a sharded weight, its products and their casts over the tp ranks
        split = layout.tp if stats.tp_sharded.get(name) else 1
        numel = rows * cols / split
        # a fully checkpointed block runs its forward product, and the casts of its input and weight, again
        again = any(within(unit, block) and p == "full" for block, p in policies.items())
        flops += (PRODUCTS + again) * 2 * tokens * numel
        # a weight gathered in float8 is cast on its shard before each gather, and used as gathered after
        weight = numel / layout.state_shards if name in gathered else numel
        cast_s += (casts_s(tokens * cols / split, CASTS_PER_TENSOR + again)  # the input
                   + casts_s(weight, CASTS_PER_TENSOR + again)
                   + casts_s(tokens * rows / split, CASTS_PER_TENSOR))  # the output's gradient
        mine += numel if name in gathered else 0.0
    saved = flops * (1 / run_rate - 1 / fp8_rate)
    return Float8Cost(saved * passes, cast_s * passes, mine, priced_at)
