"""Predict one layout's per-rank memory, communication, pipeline bubble, step time and energy.

Memory follows the ZeRO paper (Rajbhandari et al., 2020, Section 5.1) with the bytes per parameter of the
run (``StateBytes``) and what FSDP2 does on top: under ZeRO-2 it keeps the parameter shards beside the whole
parameters it gathered for forward. Activations are what autograd saved in a meta-device pass of the model
(``ModelStats``), scaled to the micro-batch, divided by tensor parallelism as Megatron's activation analysis
has it (Korthikanti et al., 2022: 24 of 34 bytes per token and width are split without sequence parallelism,
all of them with it), and kept only at checkpoint boundaries with activation checkpointing. Communication is
charged per collective in the ring model; time is the alpha-beta model of the profile's links.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from disttrain.plan.hardware import HardwareProfile, Link
from disttrain.plan.model_stats import ROOT, ModelStats, Op

OPTIMISER_STATE_BYTES = {"adamw": 8, "lamb": 8, "lars": 4}
"""Optimiser state per fp32 parameter element: two moments for Adam-style, one momentum buffer for LARS."""


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


def state_bytes(optimiser: str, momentum: float = 0.0) -> StateBytes:
    """State bytes of a run of this framework: fp32 parameters and gradients (bf16-mixed autocasts on the fly),
    and the optimiser's state."""
    optim = OPTIMISER_STATE_BYTES.get(optimiser, 4 if momentum else 0)
    return StateBytes(optim=optim)


@dataclass(frozen=True)
class Layout:
    """Degrees, ZeRO stage and batch split of one candidate run."""

    dp_replicate: int = 1
    """Replicas."""
    dp_shard: int = 1
    """Ranks that shard model state (ZeRO)."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline stages."""
    zero_stage: int = 0
    """ZeRO stage of the dp_shard dimension."""
    activation_checkpointing: bool = False
    """Recompute each shard unit in backward."""
    sequence_parallel: bool = False
    """Shard norms and dropout along the sequence too (tp > 1)."""
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
    def world_size(self) -> int:
        """Ranks of the layout."""
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def dp(self) -> int:
        """Data-parallel ranks."""
        return self.dp_replicate * self.dp_shard

    def describe(self) -> str:
        """Short text, e.g. ``dp_shard=4 zero3 tp=2 ac micro=8x2``."""
        parts = [f"{k}={v}" for k, v in (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard),
                                         ("tp", self.tp), ("pp", self.pp)) if v > 1] or ["single"]
        if self.zero_stage:
            parts.append(f"zero{self.zero_stage}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.activation_checkpointing:
            parts.append("ac")
        if self.pp > 1:
            parts.append(f"{self.schedule} m={self.microbatches}")
        parts.append(f"micro={self.micro_size}x{self.accumulation}")
        return " ".join(parts)


def model_state(params: float, layout: Layout, state: StateBytes) -> dict[str, float]:
    """Bytes per rank of parameters, gradients and optimiser state (each at its largest during a step) for
    ``params`` elements on this rank before data-parallel sharding (its tensor-parallel and pipeline share)."""
    shard = layout.dp_shard if layout.zero_stage else 1
    p = params * state.param
    if layout.zero_stage == 3:
        held = p / shard
    elif layout.zero_stage == 2 and state.zero2_keeps_shards:
        held = p + p / shard
    else:
        held = p
    # accumulating micro-batches without syncing keeps whole gradients until the step's last micro-batch
    grads = params * state.grad / (shard if layout.zero_stage >= 2 and layout.accumulation == 1 else 1)
    return {"params": held, "grads": grads, "optimizer": params * state.optim / shard}


def state_peak(params: float, layout: Layout, state: StateBytes) -> dict[str, float]:
    """Model state at the two moments it peaks: after forward (ZeRO-2 holds whole parameters; gradients exist
    only while accumulating) and after backward (ZeRO-2 has resharded; every gradient exists)."""
    terms = model_state(params, layout, state)
    shard = layout.dp_shard if layout.zero_stage else 1
    resharded = params * state.param / shard if layout.zero_stage == 2 and state.zero2_keeps_shards else terms["params"]
    carried = terms["grads"] if layout.accumulation > 1 else 0.0
    return {"after_forward": terms["params"] + carried + terms["optimizer"],
            "after_backward": resharded + terms["grads"] + terms["optimizer"]}


@dataclass
class Collective:
    """One kind of collective a rank takes part in each optimiser step."""

    kind: str
    """all_reduce, reduce_scatter, all_gather, broadcast or send (point-to-point)."""
    group: str
    """Mesh dimension it runs over (dp_replicate, dp_shard, tp, pp)."""
    size: int
    """Ranks in the group."""
    buffer_bytes: float
    """Whole-buffer bytes per step (all calls together)."""
    calls: int
    """Calls per step."""
    sent_bytes: float = 0.0
    """Bytes this rank sends per step in the ring model."""
    seconds: float = 0.0
    """Predicted time per step on the profile's link."""


RING_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n,
               "all_gather": lambda n: (n - 1) / n, "broadcast": lambda n: (n - 1) / n, "send": lambda n: 1.0}
RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "reduce_scatter": lambda n: n - 1, "all_gather": lambda n: n - 1,
              "broadcast": lambda n: n - 1, "send": lambda n: 1}


@dataclass
class Estimate:
    """The prediction for one layout on one profile."""

    layout: Layout
    """The layout."""
    memory: dict[str, float]
    """Per-rank bytes of the most loaded rank, each term at its largest: params, grads, optimizer,
    activations, transient."""
    phases: dict[str, float]
    """Bytes in use at the moments memory peaks: after forward (model state, activations and transient
    buffers) and after backward (model state)."""
    activations_plain: float
    """Activation bytes of this layout without activation checkpointing."""
    activations_checkpointed: float
    """Activation bytes of this layout with activation checkpointing (of the shard units)."""
    capacity: float
    """Memory per rank the profile allows."""
    collectives: list[Collective]
    """Collectives per optimiser step."""
    bubble: float
    """Pipeline bubble: fraction of a step the stages idle."""
    compute_s: float
    """Forward, backward (and recompute) time per step on one rank."""
    exposed_comm_s: float
    """Communication time not hidden behind compute."""
    tokens_per_step: int
    """Tokens (samples, for images) per optimiser step over all ranks."""
    watts: float | None = None
    """Power of all the devices the run occupies (a CPU run: every core of the machine), when known."""
    notes: list[str] = field(default_factory=list)
    """Assumptions worth printing with the estimate."""

    @property
    def total_bytes(self) -> float:
        """Peak bytes of the most loaded rank."""
        return max(self.phases.values())

    @property
    def fits(self) -> bool:
        """The peak fits the profile's memory."""
        return self.total_bytes <= self.capacity

    @property
    def step_s(self) -> float:
        """Predicted seconds per optimiser step."""
        return self.compute_s / (1 - self.bubble) + self.exposed_comm_s

    @property
    def tokens_per_s(self) -> float:
        """Predicted throughput over all ranks."""
        return self.tokens_per_step / self.step_s

    @property
    def joules_per_token(self) -> float | None:
        """Predicted energy per token over all devices (None when the profile has no power figure)."""
        if self.watts is None:
            return None
        return self.watts * self.step_s / self.tokens_per_step

    def overflow(self) -> str:
        """Why it does not fit: how far over and the largest term; empty when it fits."""
        if self.fits:
            return ""
        from disttrain.plan.report import human_bytes

        term = max(self.memory, key=self.memory.get)
        over = self.total_bytes - self.capacity
        return (f"needs {human_bytes(self.total_bytes)} per rank of {human_bytes(self.capacity)} "
                f"({human_bytes(over)} over); largest term: {term} {human_bytes(self.memory[term])}")


def bubble_fraction(pp: int, microbatches: int, schedule: str, stages_per_rank: int = 1) -> float:
    """Idle fraction of a pipeline step: (p - 1) / (v m + p - 1) for GPipe and 1F1B (v = 1) and the
    interleaved schedules (Narayanan et al., 2021); zero-bubble schedules a third of 1F1B's (Qi et al., 2023,
    ZB-H1), which is what their handcrafted schedules reach with equal forward, input- and weight-gradient
    times."""
    if pp <= 1:
        return 0.0
    if schedule in ("zero_bubble", "zbv"):
        return (pp - 1) / (3 * microbatches * stages_per_rank + pp - 1)
    v = stages_per_rank if schedule == "interleaved_1f1b" else 1
    return (pp - 1) / (v * microbatches + pp - 1)


def stage_units(stats: ModelStats, pp: int, stages_per_rank: int = 1) -> list[list[str]]:
    """Pipeline units of each rank, cut as the pipeline code cuts them (balanced by parameter count)."""
    from disttrain.parallel.pipeline.split import split_points

    units = stats.pipeline_units
    counts = [sum(n for name, n in stats.param_numel.items() if stats.param_unit[name] == u
                  or stats.param_unit[name].startswith(u + ".")) for u in units]
    stages = pp * stages_per_rank
    points = [*split_points(len(units), stages, counts), len(units)]
    per_stage = [units[points[i]:points[i + 1]] for i in range(stages)]
    return [sum((per_stage[s] for s in range(rank, stages, pp)), []) for rank in range(pp)]


def estimate(stats: ModelStats, layout: Layout, profile: HardwareProfile, state: StateBytes,
             bf16: bool = False) -> Estimate:
    """Predict ``layout`` for the model measured in ``stats`` on ``profile``."""
    scale = layout.micro_size / stats.micro_size
    act_dtype = 0.5 if bf16 else 1.0  # autocast keeps matmul outputs in bf16 (norms and softmax stay fp32)
    ranks = _rank_units(stats, layout)
    params = max(_rank_params(stats, layout, units) for units in ranks)
    memory = model_state(params, layout, state)
    checkpointed, plain = _activations(stats, ranks[0], layout, scale * act_dtype)
    memory["activations"] = checkpointed if layout.activation_checkpointing else plain
    memory["transient"] = _transient(stats, layout, state)
    phases = state_peak(params, layout, state)
    phases["after_forward"] += memory["activations"] + memory["transient"]
    collectives = _collectives(stats, layout, state, params, ranks, scale * act_dtype, profile,
                               gather_bf16=bf16 and not profile.cpu)
    compute = _compute_seconds(stats, layout, ranks, profile, state, params, bf16)
    shared_cpu = profile.cpu
    dp_time = sum(c.seconds for c in collectives if c.group.startswith("dp"))
    other = sum(c.seconds for c in collectives if not c.group.startswith("dp"))
    # data-parallel collectives overlap backward on GPUs; gloo on a shared CPU runs on the cores that compute
    exposed = other + (dp_time if shared_cpu else max(0.0, dp_time - compute * 2 / 3))
    # CPU ranks of this machine share its memory: a whole machine's worth split over the ranks
    capacity = (profile.memory_bytes * profile.devices_per_node / layout.world_size if profile.cpu
                else profile.memory_bytes)
    tokens = layout.micro_size * layout.accumulation * layout.dp * stats.tokens_per_sample
    return Estimate(layout, memory, phases, plain, checkpointed, capacity, collectives,
                    bubble_fraction(layout.pp, layout.microbatches, layout.schedule, layout.stages_per_rank),
                    compute, exposed, tokens, _power(profile, layout.world_size))


def _power(profile: HardwareProfile, world: int) -> float | None:
    """Watts of the devices a run of ``world`` ranks occupies (CPU ranks share all the cores of a machine)."""
    if profile.watts is None:
        return None
    if profile.cpu:
        return profile.watts * profile.devices_per_node * -(-world // profile.devices_per_node)
    return profile.watts * world


def _rank_units(stats: ModelStats, layout: Layout) -> list[list[str] | None]:
    """Units each pipeline rank holds (None: the whole model)."""
    if layout.pp == 1:
        return [None]
    return stage_units(stats, layout.pp, layout.stages_per_rank)


def _in_units(stats: ModelStats, name: str, units: list[str] | None) -> bool:
    if units is None:
        return True
    owner = stats.param_unit[name]
    return any(owner == u or owner.startswith(u + ".") for u in units)


def _rank_params(stats: ModelStats, layout: Layout, units: list[str] | None) -> float:
    """Parameter elements on a rank before data-parallel sharding: its stages', split by tensor parallelism."""
    return sum(n / (layout.tp if stats.tp_sharded.get(name) else 1)
               for name, n in stats.param_numel.items() if _in_units(stats, name, units))


def _unit_saved(stats: ModelStats, unit: str) -> int:
    return sum(b for u, b in stats.saved_bytes.items() if u == unit or (unit and u.startswith(unit + ".")))


def _activations(stats: ModelStats, units: list[str] | None, layout: Layout, scale: float) -> tuple[float, float]:
    """Activation bytes of the first pipeline rank (it keeps the most microbatches in flight), with activation
    checkpointing of the shard units and without: saved tensors plus the gradient of the output at the start
    of backward."""
    last_stage = units is None or stats.pipeline_units[-1] in units
    blocks = set(stats.shard_units)
    # each saved storage was charged to the innermost running unit once: keep the entries of this rank's units
    per_unit = {u: b for u, b in stats.saved_bytes.items()
                if units is None or (u == ROOT and last_stage) or any(u == x or u.startswith(x + ".") for x in units)}
    split = 1.0
    if layout.tp > 1:  # Megatron: 24 of 34 sbh bytes are split by tp; all of them with sequence parallelism
        split = 1 / layout.tp if layout.sequence_parallel else (10 + 24 / layout.tp) / 34
    in_blocks = {u: b * (split if u in blocks else 1.0) for u, b in per_unit.items()}
    block_units = [u for u in in_blocks if u in blocks]
    plain = sum(in_blocks.values())
    output_grad = stats.output_bytes if last_stage else 0
    plain_peak = plain + output_grad
    if block_units:
        # checkpointed: the units' inputs stay, and the output's gradient (the loss's, alive through backward);
        # the rest of the model's activations are gone by the time backward recomputes the last unit
        kept = sum(stats.unit_input_bytes.get(u, 0) for u in block_units)
        outside = plain - sum(in_blocks[u] for u in block_units)
        checkpointed_peak = kept + output_grad + max(outside, max(in_blocks[u] for u in block_units))
    else:
        checkpointed_peak = plain_peak
    in_flight = 1
    if layout.pp > 1:  # the first stage holds this many microbatches' activations (GPipe: all of them)
        in_flight = layout.microbatches if layout.schedule == "gpipe" else min(layout.microbatches, layout.pp)
        scale = scale / layout.microbatches
    return checkpointed_peak * in_flight * scale, plain_peak * in_flight * scale


def _transient(stats: ModelStats, layout: Layout, state: StateBytes) -> float:
    """Short-lived buffers: under ZeRO-3 the gathered unit and the one prefetched; under ZeRO-2/3 one unit's
    whole gradients before their reduce-scatter."""
    if layout.zero_stage < 2:
        return 0.0
    units = stats.shard_units or [ROOT]
    largest = max(sum(n / (layout.tp if stats.tp_sharded.get(name) else 1) for name, n in stats.param_numel.items()
                      if stats.param_unit[name] == u or stats.param_unit[name].startswith(u + ".")) for u in units)
    gathered = 2 * largest * state.param if layout.zero_stage == 3 else 0.0
    return gathered + largest * state.grad


def _group_link(profile: HardwareProfile, span: int) -> Link:
    """The link a group spanning ``span`` consecutive ranks uses (the mesh is pp, dp_replicate, dp_shard, tp)."""
    return profile.intra_node if span <= profile.devices_per_node else profile.inter_node


def _collective(kind: str, group: str, size: int, buffer: float, calls: int, link: Link) -> Collective:
    sent = RING_FACTOR[kind](size) * buffer
    seconds = sent / link.bandwidth + calls * RING_STEPS[kind](size) * link.latency
    return Collective(kind, group, size, buffer, calls, sent, seconds)


def _collectives(stats: ModelStats, layout: Layout, state: StateBytes, params: float,
                 ranks: list[list[str] | None], act_scale: float, profile: HardwareProfile,
                 gather_bf16: bool = False) -> list[Collective]:
    """What each rank sends per optimiser step, by group."""
    out: list[Collective] = []
    acc, tp, ds, dr = layout.accumulation, layout.tp, layout.dp_shard, layout.dp_replicate
    link_tp = _group_link(profile, tp)
    link_ds = _group_link(profile, tp * ds)
    link_dr = _group_link(profile, tp * ds * dr)
    # FSDP2 under bf16-mixed on a GPU gathers bf16 copies of the parameters (reduces gradients in fp32)
    grads, weights = params * state.grad, params * (2 if gather_bf16 else state.param)
    if layout.zero_stage == 0 and dr > 1:
        out.append(_collective("all_reduce", "dp_replicate", dr, grads, 1, link_dr))
    if layout.zero_stage == 1 and ds > 1:
        out.append(_collective("all_reduce", "dp_shard", ds, grads, 1, link_ds))
        out.append(_collective("broadcast", "dp_shard", ds, weights, ds, link_ds))
    if layout.zero_stage >= 2 and ds > 1:
        gathers = acc * (2 if layout.zero_stage == 3 else 1)
        out.append(_collective("all_gather", "dp_shard", ds, weights * gathers, gathers, link_ds))
        out.append(_collective("reduce_scatter", "dp_shard", ds, grads, 1, link_ds))
        if dr > 1:
            out.append(_collective("all_reduce", "dp_replicate", dr, grads / ds, 1, link_dr))
    if tp > 1:
        micro = act_scale * acc
        recompute = 2 if layout.activation_checkpointing else 1  # recomputed forwards all-reduce again
        forward = stats.tp_forward_bytes * micro * recompute
        backward = stats.tp_backward_bytes * micro
        kinds = ("reduce_scatter", "all_gather") if layout.sequence_parallel else ("all_reduce",)
        for kind in kinds:
            out.append(_collective(kind, "tp", tp, forward + backward, acc, link_tp))
    if layout.pp > 1:
        boundaries = [stats.unit_output_bytes.get(units[-1], 0) for units in ranks if units]
        per_micro = max(boundaries) * act_scale / layout.microbatches
        sends = 2 * layout.microbatches * acc  # activations forward, their gradients backward
        link_pp = _group_link(profile, layout.world_size)
        out.append(_collective("send", "pp", layout.pp, per_micro * sends, sends, link_pp))
    return out


def _threads_per_rank(profile: HardwareProfile, world: int) -> float:
    """Cores each rank of a CPU run computes with: the runner's ``OMP_NUM_THREADS`` (cores // ranks), or a
    share of one core when there are more ranks than cores (they take turns)."""
    cores = profile.devices_per_node
    return cores // world if world <= cores else cores / world


def _op_seconds(ops: list[Op], split: float, rates: tuple[float, float], bandwidth: float, overhead: float,
                overlapped: bool) -> float:
    """Roofline time of ``ops`` (each FLOPs and bytes divided by ``split``): the slower of compute (at the
    matrix-multiply or the convolution rate of ``rates``) and memory, plus the per-operator overhead (on a GPU
    the launch overlaps the work of the kernels before it)."""
    total = 0.0
    for flops, nbytes, conv in ops:
        work = max(flops / split / rates[conv], nbytes / split / bandwidth)
        total += max(work, overhead) if overlapped else work + overhead
    return total


def _in_block(unit: str, blocks: set[str]) -> bool:
    return unit in blocks or any(unit.startswith(b + ".") for b in blocks)


def _compute_seconds(stats: ModelStats, layout: Layout, ranks: list[list[str] | None], profile: HardwareProfile,
                     state: StateBytes, params: float, bf16: bool) -> float:
    """Forward, backward, recompute and optimiser step of the busiest rank: per-operator roofline times of the
    measured pass (tensor parallelism splits the work of the blocks; embeddings and head are replicated);
    backward is charged to units in proportion to their forward time."""
    threads = _threads_per_rank(profile, layout.world_size) if profile.cpu else 1
    dtype = "bf16" if bf16 else "fp32"
    rate = profile.flops[dtype] * threads
    rates = (rate, profile.flops.get(f"{dtype}_conv", profile.flops[dtype]) * threads)
    bandwidth = profile.memory_bandwidth * threads * (2 if bf16 else 1)  # bf16 halves the bytes moved
    blocks = set(stats.shard_units)

    cache = stats.__dict__.setdefault("_seconds", {})  # layouts share a pass: time each op list once per split

    def seconds(ops: list[Op], split: float) -> float:
        key = (id(ops), split, rates, bandwidth, profile.op_overhead, profile.cpu)
        if key not in cache:
            cache[key] = _op_seconds(ops, split, rates, bandwidth, profile.op_overhead, not profile.cpu)
        return cache[key]

    whole = sum(seconds(ops, 1) for ops in stats.forward_ops.values()) or 1.0
    forward = {u: seconds(ops, layout.tp if _in_block(u, blocks) else 1) for u, ops in stats.forward_ops.items()}
    backward = seconds(stats.backward_ops, 1)
    passes = layout.accumulation * (layout.microbatches if layout.pp > 1 else 1)
    scale = layout.micro_size / (layout.microbatches if layout.pp > 1 else 1) / stats.micro_size
    worst = 0.0
    for units in ranks:
        mine = {u: t for u, t in forward.items()
                if units is None or (u == ROOT and stats.pipeline_units[-1] in units)
                or any(u == x or u.startswith(x + ".") for x in units)}
        own_backward = backward * sum(mine.values()) / whole  # this rank's share of the whole model's forward
        recompute = sum(t for u, t in mine.items() if _in_block(u, blocks)) if layout.activation_checkpointing else 0
        worst = max(worst, sum(mine.values()) + own_backward + recompute)
    shard = layout.dp_shard if layout.zero_stage else 1
    optimiser = params / shard * (2 * state.param + state.grad + 2 * state.optim) / bandwidth
    return worst * scale * passes + optimiser
