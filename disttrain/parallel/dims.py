"""Parallel degrees ``pp x dp_replicate x dp_shard x cp x tp`` (and ``ep``, borrowed from ``dp_shard x cp``) and their
validation (no processes needed)."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from disttrain.errors import ConfigError

MESH_DIM_NAMES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    """Resolved degrees of one run; their product is the world size."""

    pp: int = 1
    """Pipeline stages."""
    dp_replicate: int = 1
    """Data-parallel replicas."""
    dp_shard: int = 1
    """Data-parallel ranks that shard model state (ZeRO)."""
    tp: int = 1
    """Tensor-parallel degree."""
    cp: int = 1
    """Context-parallel degree: ranks that each hold a slice of every sequence."""
    ep: int = 1
    """Expert-parallel degree: consecutive ranks of ``dp_shard x cp`` that each hold 1/ep of every mixture-of-experts
    layer's experts and exchange tokens with all-to-all. Not a factor of the world size: it divides dp_shard x cp."""

    @property
    def world_size(self) -> int:
        """Number of ranks the degrees describe."""
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel size: how many different micro-batches are processed at once."""
        return self.dp_replicate * self.dp_shard

    @property
    def cp_enabled(self) -> bool:
        """Whether every sequence is split over several ranks."""
        return self.cp > 1

    @property
    def gradient_ranks(self) -> int:
        """Ranks whose gradients are averaged: the data-parallel ones times the context-parallel ones (each cp
        rank computes the gradient of its slice of the same sequences)."""
        return self.dp * self.cp

    @property
    def ep_enabled(self) -> bool:
        """Whether experts are spread over several ranks."""
        return self.ep > 1

    @property
    def expert_shard_degree(self) -> int:
        """Ranks that share one copy of an expert's state under ZeRO: ``dp_shard / ep x cp``."""
        return self.shard_degree // self.ep

    def expert_meshes(self, mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh]:
        """``(ep_mesh, expert_shard_mesh)``: the 1-D mesh of the ranks that split the experts between them (``ep``
        consecutive ranks of dp_shard x cp) and the mesh FSDP shards each expert over (the other ranks of dp_shard x
        cp, or ``dp_replicate x`` those for hybrid sharding). Both come from one mesh, so FSDP can shard a
        parameter already split over ep."""
        if getattr(mesh, "_disttrain_expert_meshes", None) is None:
            shard = self.shard_mesh(mesh)
            name = shard.mesh_dim_names[-1]
            # the sharding dimension unflattened into (dp_shard x cp / ep, ep); torch's API for it is private
            split = shard._unflatten(name, (self.shard_degree // self.ep, self.ep), ("dp_shard_mod_ep", "ep"))
            rest = split["dp_replicate", "dp_shard_mod_ep"] if self.dp_replicate_enabled else split["dp_shard_mod_ep"]
            mesh._disttrain_expert_meshes = (split["ep"], rest)
        return mesh._disttrain_expert_meshes

    @property
    def pp_enabled(self) -> bool:
        """Whether the model is cut into pipeline stages."""
        return self.pp > 1

    @property
    def tp_enabled(self) -> bool:
        """Whether layers are split over tensor-parallel ranks."""
        return self.tp > 1

    @property
    def dp_enabled(self) -> bool:
        """Whether several ranks process different micro-batches."""
        return self.dp > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        """Whether whole copies of the (sharded) model state exist on several ranks."""
        return self.dp_replicate > 1

    def dp_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The 1-D mesh of all data-parallel ranks (replicate x shard joined into one dimension "dp")."""
        # torch's way of joining mesh dimensions (no public API yet); cached: later calls return the same mesh
        return mesh["dp_replicate", "dp_shard"]._flatten("dp")

    def gradient_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The 1-D mesh of the ranks that average gradients (DDP's): ``dp_replicate x dp_shard x cp`` joined into
        one dimension; the data-parallel mesh when cp is 1."""
        if not self.cp_enabled:
            return self.dp_mesh(mesh)
        return mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")

    def shard_mesh(self, mesh: DeviceMesh) -> DeviceMesh:
        """The mesh FSDP shards over: ``dp_shard`` (joined with ``cp``, so context-parallel ranks share parameter
        memory too), or ``dp_replicate x`` that for hybrid sharding."""
        shard = "dp_shard"
        if self.cp_enabled:
            mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            shard = "dp_shard_cp"
        return mesh["dp_replicate", shard] if self.dp_replicate_enabled else mesh[shard]

    @property
    def shard_degree(self) -> int:
        """Ranks that share one copy of the model state under ZeRO: ``dp_shard x cp``."""
        return self.dp_shard * self.cp

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Sizes in ``MESH_DIM_NAMES`` order (size-1 dims included, so names are always valid)."""
        return (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)

    @classmethod
    def resolve(cls, world_size: int, pp: int, dp_replicate: int, dp_shard: int, tp: int, cp: int = 1, ep: int = 1
                ) -> ParallelDims:
        """Fill in the one degree given as -1 ("the rest of the world") and check the product; ``ep`` must divide
        the resolved dp_shard.

        Raises ConfigError naming the degrees when they cannot multiply to ``world_size``.
        """
        if ep < 1:
            raise ConfigError("parallel.ep", ep, "a positive degree (1: every rank holds all experts)")
        given = {"pp": pp, "dp_replicate": dp_replicate, "dp_shard": dp_shard, "cp": cp, "tp": tp}
        for key, value in given.items():
            if value == 0 or value < -1:
                raise ConfigError(f"parallel.{key}", value, "a positive degree, or -1 for the rest of the world")
        rest = [key for key, value in given.items() if value == -1]
        if len(rest) > 1:
            raise ConfigError(f"parallel.{rest[1]}", -1, f"at most one degree may be -1, got -1 for {rest}")
        known = 1
        for value in given.values():
            known *= value if value != -1 else 1
        if rest:
            if world_size % known:
                raise ConfigError(
                    f"parallel.{rest[0]}", -1,
                    f"the other degrees multiply to {known}, which does not divide world size {world_size}",
                )
            given[rest[0]] = world_size // known
        dims = cls(**given, ep=ep)
        if dims.shard_degree % ep:
            raise ConfigError("parallel.ep", ep, f"a divisor of parallel.dp_shard x parallel.cp = {dims.dp_shard} x "
                              f"{dims.cp} (experts are split over ranks that shard the model state, e.g. "
                              "parallel=zero3 shards over every rank; raise dp_shard or lower ep)")
        if dims.world_size != world_size:
            raise ConfigError(
                "parallel", " x ".join(f"{k}={v}" for k, v in given.items()),
                f"the degrees multiply to {dims.world_size} but the world size is {world_size} "
                "(trainer.devices x trainer.num_nodes, or the launcher's WORLD_SIZE)",
            )
        return dims
