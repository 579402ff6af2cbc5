"""The layout of a run: its resolved degrees and how model state is laid out over them, decided once.

The runtime (the strategy, ``apply_parallelism``, the pipeline, the gradient meter), validation's checks and the
planner read this one object; none of them tests the ZeRO stage as a number. The predicates say what a stage
means where it is used:

    ZeRO stage                    0     1     2     3
    shards_optimizer_state        -     yes   yes   yes
    shards_only_optimizer_state   -     yes   -     -     (the strategy wraps the optimiser; DDP the model)
    shards_gradients              -     -     yes   yes
    shards_parameters             -     -     yes   yes   (FSDP2 wraps the model)
    keeps_gathered_parameters     -     -     yes   -     (a unit stays whole from its forward to its backward)
    reshards_after_forward        -     -     -     yes
    gathers_per_microbatch        1     1     1     2
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from disttrain.parallel.dims import ParallelDims

ZERO_FIELD = "zero_stage"
"""The ``parallel`` field of the ZeRO stage, for messages that name it."""

WRAPPERS = ("none", "ddp", "fsdp", "pipeline")
"""What a layout wraps the model in (``Layout.wrapper``)."""


@dataclass(frozen=True)
class Layout(ParallelDims):
    """A run's degrees (it is a ``ParallelDims``: the mesh, the degrees and their meshes are read from it directly)
    plus the ZeRO stage and the options that decide where model state lives. Built once from the config by
    ``Layout.of``; the planner's candidates extend it (``disttrain.plan.layout``)."""

    zero_stage: int = 0
    """ZeRO stage of the data-parallel ranks that share the model state (dp_shard x cp). Read through the
    predicates below; the number itself is for messages (``zero_setting``)."""
    accumulate_grads: str = "auto"
    """``parallel.accumulate_grads``: where ZeRO-2/3 accumulate gradients between micro-batches."""
    activation_checkpoint: str = "none"
    """Checkpointing policy of the shard units: none; full (keep each unit's input, recompute its forward in
    backward); selective (keep also the outputs of its matrix products and attention, recompute the rest)."""
    checkpoint_every_n_blocks: int = 1
    """The policy applies to every n-th shard unit only; the others keep every activation."""
    sequence_parallel: bool = False
    """Shard norms and dropout along the sequence too (tp > 1)."""
    cpu_offload: bool = False
    """ZeRO-2/3: parameter shards, gradients and the optimiser step live on the CPU."""
    ddp_exchange: bool = True
    """Data-parallel replicas average gradients every step through their wrapper (DDP or FSDP2); False: the kind of
    run exchanges updates itself (Local SGD and DiLoCo, a parameter server, federated clients) and replicas stay
    unwrapped."""

    @classmethod
    def of(cls, parallel: Any, dims: ParallelDims, **extra: Any) -> Layout:
        """The layout of ``parallel`` (a ``ParallelConfig``) over the resolved degrees ``dims``; ``extra``: fields
        of a subclass (the planner's batch split)."""
        return cls(pp=dims.pp, dp_replicate=dims.dp_replicate, dp_shard=dims.dp_shard, tp=dims.tp, cp=dims.cp,
                   ep=dims.ep, zero_stage=parallel.zero_stage, accumulate_grads=parallel.accumulate_grads,
                   activation_checkpoint=parallel.activation_checkpoint,
                   checkpoint_every_n_blocks=parallel.checkpoint_every_n_blocks,
                   sequence_parallel=parallel.sequence_parallel, cpu_offload=parallel.cpu_offload,
                   ddp_exchange=not (parallel.federated or parallel.sync_every or parallel.servers), **extra)

    @classmethod
    def on(cls, parallel: Any, world: int) -> Layout:
        """The layout of ``parallel`` (a ``ParallelConfig``) on ``world`` ranks: its degrees resolved (a degree of -1
        takes the ranks the others leave)."""
        p = parallel
        return cls.of(p, ParallelDims.resolve(world, p.pp, p.dp_replicate, p.dp_shard, p.tp, p.cp, p.ep))

    @classmethod
    def of_stage(cls, stage: int, **fields: Any) -> Layout:
        """A layout of ZeRO stage ``stage`` (0 to 3) and ``fields``: how the planner enumerates candidates."""
        return cls(zero_stage=stage, **fields)

    def applied_to(self, parallel: Any) -> Any:
        """A copy of ``parallel`` (a ``ParallelConfig``) with what the planner chooses written in: this layout's
        degrees, ZeRO stage, checkpointing and sequence parallelism (accumulation, offload and the kind of run
        stay the config's)."""
        return replace(parallel, dp_replicate=self.dp_replicate, dp_shard=self.dp_shard, tp=self.tp, pp=self.pp,
                       cp=self.cp, ep=self.ep, zero_stage=self.zero_stage,
                       activation_checkpoint=self.activation_checkpoint,
                       checkpoint_every_n_blocks=self.checkpoint_every_n_blocks,
                       sequence_parallel=self.sequence_parallel)

    @property
    def shards_optimizer_state(self) -> bool:
        """ZeRO of any stage: each rank of dp_shard x cp keeps the optimiser state of its share of the parameters."""
        return self.zero_stage >= 1

    @property
    def shards_only_optimizer_state(self) -> bool:
        """ZeRO-1: the optimiser state is sharded (the strategy wraps the optimiser), while gradients and parameters
        stay whole on every rank (DDP replicates the model)."""
        return self.zero_stage == 1

    @property
    def shards_gradients(self) -> bool:
        """ZeRO-2/3: each rank keeps the gradients of its shard (a reduce-scatter instead of an all-reduce)."""
        return self.zero_stage >= 2

    @property
    def shards_parameters(self) -> bool:
        """ZeRO-2/3: parameters are sharded at rest and gathered per unit, the model is wrapped in FSDP2."""
        return self.zero_stage in (2, 3)

    @property
    def keeps_gathered_parameters(self) -> bool:
        """ZeRO-2: a unit's parameters, gathered for its forward, stay whole beside their shards until its backward
        (FSDP2 without resharding after forward)."""
        return self.zero_stage == 2

    @property
    def reshards_after_forward(self) -> bool:
        """ZeRO-3: a unit's gathered parameters are freed after its forward and gathered again for its backward."""
        return self.zero_stage == 3

    @property
    def gathers_per_microbatch(self) -> int:
        """Parameter all-gathers per micro-batch under sharding: 2 under ZeRO-3 (forward, and backward after
        resharding), else 1."""
        return 2 if self.reshards_after_forward else 1

    @property
    def sharded_accumulation(self) -> bool:
        """Accumulation micro-batches reduce-scatter into gradient shards: ZeRO-2/3 without pipelining (a schedule
        reduces once per batch), unless ``accumulate_grads`` is unsharded (whole local gradients until the step's
        last micro-batch reduce-scatters once)."""
        return self.pp == 1 and self.shards_gradients and self.accumulate_grads != "unsharded"

    @property
    def state_shards(self) -> int:
        """Ranks one copy of the model state is sharded over: dp_shard x cp under ZeRO (ZeRO-1 with cp > 1 is
        refused), none without."""
        return self.shard_degree if self.shards_optimizer_state else 1

    @property
    def expert_state_shards(self) -> int:
        """Ranks one copy of an expert's state is sharded over: dp_shard / ep x cp under ZeRO (expert parallelism
        needs ZeRO-2/3; each rank holds 1/ep of the experts besides), none without."""
        return self.expert_shard_degree if self.shards_optimizer_state else 1

    @property
    def wrapper(self) -> str:
        """What the model is wrapped in (``WRAPPERS``): pipeline stages (pp > 1), FSDP2 (ZeRO-2/3, also on one
        rank), DDP (ranks that average gradients through it), or none (one rank, or replicas that exchange
        updates themselves)."""
        if self.pp_enabled:
            return "pipeline"
        if self.shards_parameters:
            return "fsdp"
        if self.gradient_ranks > 1 and self.ddp_exchange:
            return "ddp"
        return "none"

    @property
    def zero_setting(self) -> str:
        """The ZeRO stage as its config setting, for messages: e.g. ``zero_stage=3`` (``parallel.`` before it makes
        the key)."""
        return f"{ZERO_FIELD}={self.zero_stage}"

    @property
    def zero_name(self) -> str:
        """The ZeRO stage as the literature names it, for messages: e.g. ``ZeRO-3``."""
        return f"ZeRO-{self.zero_stage}"

    @property
    def zero_preset(self) -> str:
        """The ``parallel`` preset of this ZeRO stage: ``zero1``, ``zero2`` or ``zero3`` (empty without ZeRO)."""
        return f"zero{self.zero_stage}" if self.shards_optimizer_state else ""

    def describe(self) -> str:
        """Short text, e.g. ``dp_shard=4 ep=2 cp=2 zero3 tp=2 ac=selective`` (``ac=full every 2`` when the policy
        covers every second unit)."""
        parts = [f"{k}={v}" for k, v in (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard),
                                         ("ep", self.ep), ("cp", self.cp), ("tp", self.tp), ("pp", self.pp))
                 if v > 1] or ["single"]
        if self.shards_optimizer_state:
            parts.append(self.zero_preset)
        if self.sequence_parallel:
            parts.append("sp")
        if self.activation_checkpoint != "none":
            every = self.checkpoint_every_n_blocks
            parts.append(f"ac={self.activation_checkpoint}" + (f" every {every}" if every > 1 else ""))
        return " ".join(parts)
