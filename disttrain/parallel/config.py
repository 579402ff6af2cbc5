"""Schema of the ``parallel`` group: a preset of mesh degrees plus the options of each strategy."""

from __future__ import annotations

from dataclasses import dataclass, field

from disttrain.errors import ConfigError
from disttrain.parallel.dims import ParallelDims


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


@dataclass
class ParallelConfig:
    """How a run is spread over ranks: mesh degrees ``pp x dp_replicate x dp_shard x tp`` and options."""

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
    zero_stage: int = 0
    """0: plain replication; 1, 2, 3: ZeRO stage of the sharded data-parallel dimension."""
    ddp: DDPOptions = field(default_factory=DDPOptions)
    """Options used when gradients are all-reduced by DDP."""
    backend: str | None = None
    """torch.distributed backend; null: gloo on CPU, nccl on GPU."""
    timeout_s: int = 1800
    """Seconds a collective may wait before the run fails."""

    def validate(self) -> None:
        """Checks that need no world size."""
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError("parallel.zero_stage", self.zero_stage, "one of 0, 1, 2, 3")
        if self.backend not in (None, "gloo", "nccl"):
            raise ConfigError("parallel.backend", self.backend, "null, gloo or nccl")
        if self.ddp.bucket_cap_mb <= 0:
            raise ConfigError("parallel.ddp.bucket_cap_mb", self.ddp.bucket_cap_mb, "a positive size in MiB")
        if self.timeout_s <= 0:
            raise ConfigError("parallel.timeout_s", self.timeout_s, "a positive number of seconds")

    def check_dims(self, dims: ParallelDims) -> None:
        """Checks of the combination of options and resolved degrees."""
        unsupported = {"tp": dims.tp, "pp": dims.pp}
        for key, value in unsupported.items():
            if value > 1:
                raise ConfigError(f"parallel.{key}", value, "1 (this degree is not available yet)")
        if dims.dp_shard > 1 and self.zero_stage == 0:
            raise ConfigError("parallel.zero_stage", 0, "1, 2 or 3 when parallel.dp_shard > 1 (sharding is ZeRO)")
        if self.zero_stage and dims.dp_shard == 1 and dims.dp_replicate == 1:
            raise ConfigError("parallel.zero_stage", self.zero_stage, "0 on a single rank (nothing to shard)")
        if self.zero_stage:
            raise ConfigError("parallel.zero_stage", self.zero_stage, "0 (ZeRO is not available yet)")
