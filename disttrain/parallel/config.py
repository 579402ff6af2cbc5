"""Schema of the ``parallel`` group: a preset of mesh degrees plus the options of each strategy."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from disttrain import checks
from disttrain.errors import ConfigError
from disttrain.parallel.dims import ParallelDims
from disttrain.parallel.layout import Layout


@dataclass
class DDPOptions:
    """Options of replicated data parallelism (torch DistributedDataParallel)."""

    bucket_cap_mb: float = 25.0
    """Gradient bucket size in MiB: larger buckets mean fewer, bigger all-reduces."""
    gradient_as_bucket_view: bool = True
    """Let gradients alias the communication buckets (saves one copy of the gradients)."""
    static_graph: bool = False
    """Promise that the set of used parameters never changes (enables more overlap)."""
    find_unused_parameters: bool = False
    """Search the graph for parameters that got no gradient (needed only by models that skip layers)."""
    forward_sync_buffers: bool | None = None
    """Copy the first rank's buffers to every rank before each training forward, as torch DDP does by default.
    null: only when the model holds buffers other than normalisation layers' running statistics, which a
    training forward does not read (ranks get the first rank's before every evaluation and checkpoint anyway)."""


@dataclass
class PipelineOptions:
    """Options of pipeline parallelism (torch.distributed.pipelining), used when parallel.pp > 1."""

    schedule: str = "1f1b"
    """One of gpipe, 1f1b, interleaved_1f1b, zero_bubble (interleaved zero bubble), zbv."""
    microbatches: int = 4
    """Micro-batches each rank's batch is split into per step (at least pp for 1f1b)."""
    stages_per_rank: int = 1
    """Stages each rank holds: 1 for gpipe/1f1b, 2 or more for the interleaved schedules, 2 for zbv."""
    split_points: list[int] | None = None
    """Pipeline-unit index where each stage after the first starts; null: balanced by parameter count."""
    timeline: bool = False
    """Time each forward and backward action per microbatch and stage during one training step after
    warm-up (the first batch of the second optimiser step) and write it after training as
    ``plots/pipeline_timeline.json`` and, unless ``plots=false``, ``plots/pipeline_timeline.png``."""


@dataclass
class OuterOptions:
    """The outer step of ``parallel.sync_every`` > 0: SGD on the global parameters with the replicas' mean
    drift from them as its gradient. lr 1 without momentum is Local SGD's plain average; DiLoCo (Douillard
    et al., 2023) uses lr 0.7 with Nesterov momentum 0.9."""

    lr: float = 1.0
    """Outer learning rate (1 with momentum 0: the global parameters become the replicas' average)."""
    momentum: float = 0.0
    """Outer momentum; its buffer is in the checkpoint."""
    nesterov: bool = False
    """Nesterov momentum (needs momentum > 0)."""

    def is_plain_average(self) -> bool:
        """The outer step only averages the replicas (Local SGD)."""
        return self.lr == 1.0 and self.momentum == 0.0


ACCUMULATE_GRADS = ("auto", "sharded", "unsharded")
"""Values of ``parallel.accumulate_grads``."""

ACTIVATION_CHECKPOINT = ("none", "full", "selective")
"""Values of ``parallel.activation_checkpoint``."""

SPLIT_BACKWARD = ("zero_bubble", "zbv")
"""Pipeline schedules that split a stage's backward into an input-gradient and a weight-gradient pass."""


@dataclass
class ParallelConfig:
    """How a run is spread over ranks: mesh degrees ``pp x dp_replicate x dp_shard x cp x tp`` and options."""

    name: str = "single"
    """Preset name (single, ddp, ...); behaviour follows from the degrees and options below."""
    dp_replicate: int = 1
    """Data-parallel replicas (DDP-style). -1: the rest of the world."""
    dp_shard: int = 1
    """Data-parallel ranks that shard the model state (ZeRO/FSDP). -1: the rest of the world."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree."""
    cp: int = 1
    """Context-parallel degree: every sequence is split over cp ranks (each holds an early and a late chunk of
    it, so causal attention's work is balanced), and attention gathers the keys and values of the whole sequence
    over them. Needs a text model whose attention takes the split (gpt, llama, hf Llama-family) and a sequence
    length divisible by 2 x cp. ZeRO-2/3 shard over dp_shard x cp. -1: the rest of the world."""
    ep: int = 1
    """Expert-parallel degree for mixture-of-experts models: each mixture layer's experts are split over ep
    consecutive ranks of dp_shard x cp (a divisor of it), which send each token to its experts' rank and back with
    all-to-all; attention, norms and the router stay data-parallel (ZeRO over dp_shard x cp), each expert is
    sharded over the remaining dp_shard x cp / ep ranks, and its gradient is averaged over every rank that
    trained on tokens. Needs zero_stage 2 or 3 and a model with experts (model=moe) whose expert count ep
    divides. Under tp the experts are not tensor-parallel: every tp rank runs the mixture on the same tokens.
    1: every rank holds all experts."""
    zero_stage: int = 0
    """0: plain replication; 1, 2, 3: ZeRO stage of the sharded data-parallel dimension."""
    accumulate_grads: str = "auto"
    """ZeRO-2/3 with batch.accumulation > 1: where gradients accumulate between micro-batches. sharded: every
    micro-batch reduce-scatters its gradients into this rank's shard (gradient memory 1/dp_shard; one
    reduce-scatter of the gradients per micro-batch, overlapped with backward like the last one). unsharded:
    micro-batches before the last add into whole local gradients and the last reduce-scatters once (whole
    gradients per rank while accumulating; one reduce-scatter per step). auto: sharded, the memory ZeRO-2/3
    are chosen to save (whole gradients are dp_shard times larger), for data-parallel bytes that stay below
    1.5x (ZeRO-3, which gathers parameters twice per micro-batch anyway) or 2x (ZeRO-2) of unsharded
    accumulation's and overlap backward as the last micro-batch's do. sharded and unsharded need zero_stage 2
    or 3 and pp 1 (a pipeline schedule reduces once per batch, after its microbatches)."""
    sequence_parallel: bool = False
    """With tp > 1: also shard norms and dropout along the sequence (less activation memory)."""
    activation_checkpoint: str = "none"
    """What the shard units (blocks) keep for backward. none: every activation. full: only each block's input;
    backward runs the block's forward again (least memory, about one more forward of compute). selective: the
    outputs of matrix products, attention and collectives; the element-wise work between them (norms,
    activation functions, residual adds, dropout) is recomputed (memory between the two, little extra compute;
    see ``disttrain.parallel.activation_checkpoint``)."""
    checkpoint_every_n_blocks: int = 1
    """Apply ``activation_checkpoint`` to every n-th block only (the n-th, 2n-th, ... counting from 1, as
    torchtitan counts); the others keep all their activations. 1: every block."""
    cpu_offload: bool = False
    """ZeRO-2/3 on GPU: keep parameter shards, gradients and the optimiser step on the CPU."""
    min_params_per_unit: int = 100_000
    """ZeRO-2/3 of a model with neither shard units nor a ModuleList: direct children at least this large
    become sharding units."""
    tp_plan: Any = None
    """Tensor-parallel plan for a model that declares none (or to replace its own): module-name pattern -> a style
    of disttrain.models.protocol.TP_STYLES (colwise, rowwise, ...); null: the model's own tp_plan(). Typed Any, so
    that ``parallel.tp_plan={...}`` on the command line merges into null (OmegaConf cannot merge a mapping into a
    typed mapping that is null); ``validate`` checks it is a mapping of names to names."""
    pipeline_units: list[str] | None = None
    """Pipeline units for a model that declares none: ordered submodule names whose application in turn is
    its forward (a ModuleList stands for its entries)."""
    shard_units: list[str] | None = None
    """Submodules that each become an FSDP (and activation-checkpointing) unit; null: the model's
    shard_units(), else its repeated blocks."""
    sync_every: int = 0
    """Local SGD / DiLoCo: optimiser steps each data-parallel replica takes alone (no gradient exchange)
    before the replicas meet in an outer step; 0: gradients are all-reduced every step (DDP)."""
    outer: OuterOptions = field(default_factory=OuterOptions)
    """The outer step when ``sync_every`` > 0."""
    servers: int = 0
    """Parameter server: the first ``servers`` ranks each own a share of the parameters and their optimiser
    state; every rank pushes gradients to them and pulls parameters back each step; 0: no servers."""
    staleness: int = 0
    """Parameter server: 0 averages every rank's gradient each step (synchronous); s > 0 applies each
    gradient alone as it arrives, dropping one more than s versions old (asynchronous, bounded staleness)."""
    ddp: DDPOptions = field(default_factory=DDPOptions)
    """Options used when gradients are all-reduced by DDP."""
    pipeline: PipelineOptions = field(default_factory=PipelineOptions)
    """Options used when parallel.pp > 1."""
    backend: str | None = None
    """torch.distributed backend; null: gloo on CPU, nccl on GPU."""
    timeout_s: int = 1800
    """Seconds a collective may wait before the run fails."""

    @property
    def federated(self) -> bool:
        """Ranks simulate federated clients (``parallel=federated``; the ``federated`` node holds the options):
        the model is not wrapped in DDP, clients exchange whole updates once a round."""
        return self.name == "federated"

    @property
    def sharded_accumulation(self) -> bool:
        """Accumulation micro-batches reduce-scatter their gradients (see ``accumulate_grads``), as the layout of
        these options without pipelining says (``Layout.sharded_accumulation``)."""
        return Layout.of(self, ParallelDims()).sharded_accumulation

    def fixed_ranks(self) -> int | None:
        """The one world size this preset runs on when none of its degrees is -1 (``single``: 1), else None."""
        degrees = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        return None if -1 in degrees else self.fewest_ranks()

    def fewest_ranks(self) -> int:
        """The smallest world size this preset runs on: its fixed degrees, and 2 for a degree of -1."""
        fewest = 1
        for degree in (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp):
            fewest *= 2 if degree == -1 else max(degree, 1)
        return fewest

    def validate(self) -> None:
        """Checks that need no world size."""
        if self.tp_plan is not None and not (isinstance(self.tp_plan, dict) and all(
                isinstance(key, str) and isinstance(style, str) for key, style in self.tp_plan.items())):
            raise ConfigError("parallel.tp_plan", self.tp_plan, "null or a mapping of module-name patterns to "
                              "style names, e.g. {layers.*.self_attn.q_proj:colwise,layers.*.self_attn.o_proj:rowwise}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError("parallel.zero_stage", self.zero_stage, "one of 0, 1, 2, 3")
        if self.accumulate_grads not in ACCUMULATE_GRADS:
            raise ConfigError("parallel.accumulate_grads", self.accumulate_grads, "auto, sharded or unsharded")
        checks.one_of("parallel.activation_checkpoint", self.activation_checkpoint, ACTIVATION_CHECKPOINT)
        if self.checkpoint_every_n_blocks < 1:
            raise ConfigError("parallel.checkpoint_every_n_blocks", self.checkpoint_every_n_blocks,
                              "a positive number of blocks (1: every block)")
        if self.backend not in (None, "gloo", "nccl"):
            raise ConfigError("parallel.backend", self.backend, "null, gloo or nccl")
        if self.ddp.bucket_cap_mb <= 0:
            raise ConfigError("parallel.ddp.bucket_cap_mb", self.ddp.bucket_cap_mb, "a positive size in MiB")
        if self.min_params_per_unit < 1:
            raise ConfigError("parallel.min_params_per_unit", self.min_params_per_unit, "a positive count")
        if self.timeout_s <= 0:
            raise ConfigError("parallel.timeout_s", self.timeout_s, "a positive number of seconds")
        if self.sync_every < 0:
            raise ConfigError("parallel.sync_every", self.sync_every, "0 (all-reduce every step) or a positive "
                              "number of steps between outer steps")
        if self.servers < 0:
            raise ConfigError("parallel.servers", self.servers, "0 (no parameter server) or a number of server ranks")
        if self.staleness < 0:
            raise ConfigError("parallel.staleness", self.staleness, "0 (synchronous) or a number of versions")
        if self.staleness and not self.servers:
            raise ConfigError("parallel.staleness", self.staleness, "0 unless parallel.servers > 0 (staleness is a "
                              "parameter server's)")
        if self.servers and self.sync_every:
            raise ConfigError("parallel.servers", self.servers, "0 with parallel.sync_every > 0 (a parameter server "
                              "steps every step)")
        if self.outer.lr <= 0:
            raise ConfigError("parallel.outer.lr", self.outer.lr, "a positive learning rate")
        if not 0 <= self.outer.momentum < 1:
            raise ConfigError("parallel.outer.momentum", self.outer.momentum, "a number in [0, 1)")
        if self.outer.nesterov and self.outer.momentum == 0:
            raise ConfigError("parallel.outer.nesterov", True, "false unless parallel.outer.momentum > 0")

    def check_layout(self, layout: Layout) -> None:
        """Checks of the combination of options and resolved degrees: ``layout`` is ``Layout.of(self, dims)``."""
        for key, value in (("sync_every", self.sync_every), ("servers", self.servers)):
            if value and (layout.dp_replicate < 2 or layout.world_size != layout.dp_replicate):
                raise ConfigError(f"parallel.{key}", value,
                                  f"0 unless every rank is a data-parallel replica (dp_replicate = world size >= 2; "
                                  f"got dp_replicate={layout.dp_replicate} of {layout.world_size} ranks, zero_stage="
                                  f"{self.zero_stage}, tp={layout.tp}, pp={layout.pp})")
        if self.servers > layout.world_size:
            raise ConfigError("parallel.servers", self.servers, f"at most the {layout.world_size} ranks of the run")
        if layout.pp_enabled and (layout.dp_replicate_enabled or layout.shards_only_optimizer_state):
            raise ConfigError("parallel.pp", layout.pp,
                              "pp > 1 combines with tp and with dp_shard (zero_stage 2 or 3); dp_replicate and "
                              "zero_stage=1 with pipelining are not available yet")
        if layout.pp_enabled and self.sequence_parallel:
            raise ConfigError("parallel.sequence_parallel", True, "false with pp > 1 (not available yet)")
        if layout.pp_enabled and self.activation_checkpoint == "selective" and self.pipeline.schedule in SPLIT_BACKWARD:
            raise ConfigError("parallel.activation_checkpoint", "selective",
                              f"none or full with the {self.pipeline.schedule} schedule (it runs a block's backward "
                              "in two passes, input then weight gradients, and torch's selective checkpoint "
                              "recomputes a block for one backward only)")
        if layout.tp_enabled and layout.dp_replicate_enabled and not layout.shards_parameters:
            raise ConfigError("parallel.dp_replicate", layout.dp_replicate,
                              "1 with tp > 1 unless zero_stage is 2 or 3 (DDP cannot replicate tensor-parallel "
                              "parameters; shard them with dp_shard, or use hybrid sharding)")
        if layout.tp_enabled and layout.cp_enabled and not layout.shards_parameters:
            raise ConfigError("parallel.zero_stage", self.zero_stage,
                              "2 or 3 with tp > 1 and cp > 1 (DDP cannot average tensor-parallel parameters' gradients "
                              "over the cp ranks; FSDP shards them over dp_shard x cp)")
        if self.sequence_parallel and not layout.tp_enabled:
            raise ConfigError("parallel.sequence_parallel", True, f"false unless parallel.tp > 1 (tp={layout.tp} of "
                              f"{layout.world_size} rank(s) here)")
        if layout.dp_shard > 1 and not layout.shards_optimizer_state:
            raise ConfigError("parallel.zero_stage", 0, "1, 2 or 3 when parallel.dp_shard > 1 (sharding is ZeRO)")
        # one rank under ZeRO-2/3 is FSDP2 with nothing to shard: still its mixed-precision policy and CPU offload
        single_device_fsdp = layout.shards_parameters and layout.world_size == 1
        if layout.shards_optimizer_state and layout.shard_degree == 1 and not single_device_fsdp:
            raise ConfigError("parallel.dp_shard", layout.dp_shard,
                              f"> 1 (or parallel.cp > 1) for zero_stage={self.zero_stage} (the ranks that share the "
                              f"model state), or zero_stage 2 or 3 on one rank; world size {layout.world_size} gives "
                              "nothing to shard")
        if layout.cp_enabled and layout.shards_only_optimizer_state:
            raise ConfigError("parallel.zero_stage", 1, "0, 2 or 3 with parallel.cp > 1 (ZeRO-1 shards optimiser "
                              "state over the data-parallel ranks only)")
        if layout.cp_enabled and layout.pp_enabled and not layout.shards_parameters:
            raise ConfigError("parallel.zero_stage", self.zero_stage, "2 or 3 with parallel.cp > 1 and pp > 1 (the "
                              "stages' gradients are averaged over dp_shard x cp by FSDP)")
        if self.accumulate_grads != "auto" and (not layout.shards_gradients or layout.pp_enabled):
            raise ConfigError("parallel.accumulate_grads", self.accumulate_grads,
                              f"auto unless zero_stage is 2 or 3 and pp is 1 (only ZeRO-2/3 shard gradients; a "
                              f"pipeline schedule reduces them once per batch; got zero_stage={self.zero_stage}, "
                              f"pp={layout.pp})")
        if layout.ep_enabled and not layout.shards_parameters:
            raise ConfigError("parallel.zero_stage", self.zero_stage,
                              f"2 or 3 with parallel.ep={layout.ep} (experts' gradients are averaged over other ranks "
                              "than the dense layers', which FSDP does per unit), e.g. parallel=zero3")
        if layout.ep_enabled and self.activation_checkpoint == "selective":
            raise ConfigError("parallel.activation_checkpoint", "selective",
                              f"none or full with parallel.ep={layout.ep} (each experts' module is an FSDP unit of its "
                              "own inside its block, whose hooks run a different sequence of operations when torch's "
                              "selective checkpoint recomputes the block; not available yet)")
        if layout.ep_enabled and self.sequence_parallel:
            raise ConfigError("parallel.sequence_parallel", True, f"false with parallel.ep={layout.ep} (the mixture "
                              "layers take whole sequences; not available yet)")
        if self.cpu_offload and not layout.shards_parameters:
            raise ConfigError("parallel.cpu_offload", True, "false unless zero_stage is 2 or 3")
