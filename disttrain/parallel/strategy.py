"""The one Lightning strategy of disttrain: it owns the DeviceMesh and applies parallelism to the model.

It derives from Lightning's ``ModelParallelStrategy`` (the only Lightning strategy that runs FSDP2 and
DTensor on a CPU/gloo mesh) and replaces its 2-D mesh with the 4-D ``pp x dp_replicate x dp_shard x tp``
mesh, applies the plan itself (no ``configure_model`` hook needed in the task), and writes checkpoints
as sharded folders that replace the previous one atomically.
"""

from __future__ import annotations

import shutil
from collections.abc import Generator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.state_dict import StateDictOptions
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from disttrain.checkpoint_io import METADATA_FILE, load_metadata, load_sharded
from disttrain.comm.config import CommConfig
from disttrain.comm.counter import ByteCounter
from disttrain.comm.state import ExchangeState
from disttrain.parallel.apply import apply_parallelism, backward_sync_disabled
from disttrain.parallel.async_server import AsyncParameterServerOptimizer
from disttrain.parallel.buffers import broadcast_buffers, step_broadcast_needed
from disttrain.parallel.config import ParallelConfig
from disttrain.parallel.dims import MESH_DIM_NAMES, ParallelDims
from disttrain.parallel.param_server import ParameterServerOptimizer
from disttrain.parallel.pipeline.runtime import PipelineSlot, build_pipeline
from disttrain.parallel.zero1 import (
    load_zero1_named_state_dict,
    shard_optimizer_state,
    zero1_named_state_dict,
    zero1_named_template,
)

# Optimiser state keyed by parameter name, hyper-parameters included: pipeline stages hold different
# parameters, and nested param groups of different stages would collide in one checkpoint.
FLAT_STATE = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)


class DistTrainStrategy(ModelParallelStrategy):
    """Builds the mesh of ``dims`` and applies ``parallel`` to the task's ``net`` before optimisers exist."""

    def __init__(
        self, parallel: ParallelConfig, dims: ParallelDims, precision: str = "32-true", sync_batchnorm: bool = False,
        pipeline: PipelineSlot | None = None, async_save: bool = False, comm: CommConfig | None = None,
        compile: bool = False,
    ) -> None:
        super().__init__(
            data_parallel_size=dims.dp,
            tensor_parallel_size=dims.tp,
            save_distributed_checkpoint=True,
            process_group_backend=parallel.backend,
            timeout=timedelta(seconds=parallel.timeout_s),
        )
        self.parallel = parallel
        self.dims = dims
        self.precision = precision
        self.sync_batchnorm = sync_batchnorm
        self.pipeline = pipeline
        """Where a pipelined run's stages and schedule go (shared with the task); None: not pipelined."""
        self.async_save = async_save
        """Write checkpoints in the background (one save in flight)."""
        self.comm = comm
        """What DDP's gradients are sent as (None: DDP's own fp32 all-reduce)."""
        self.compile = compile
        """torch.compile the model once its layout is applied."""
        self.comm_counter = ByteCounter()
        """Bytes this rank sent through disttrain's gradient exchange."""
        self.comm_state = ExchangeState()
        """What this rank's gradient exchange carries between steps (residuals, PowerSGD's factors)."""
        self._parallelised = False
        self._step_broadcast: bool | None = None
        """Whether buffers are broadcast before each training batch (decided at the first one)."""
        self._pending_save: tuple[Any, Path, Path] | None = None
        self.checkpoint_saves = 0
        """Checkpoints this process saved."""
        self.checkpoint_blocking_s = 0.0
        """Seconds training waited for them (staging only, when saving asynchronously)."""
        self._checkpoint_group: Any = None

    @property
    def replicas_differ(self) -> bool:
        """Data-parallel replicas hold different parameters between exchanges (Local SGD, DiLoCo, an
        asynchronous parameter server): checkpoints keep every rank's own."""
        return bool(self.parallel.sync_every or self.parallel.staleness)

    def setup_environment(self) -> None:
        """Join the process group (or reuse the launcher's) and build the named 4-D mesh."""
        self._setup_distributed()
        device_type = self.root_device.type
        self._device_mesh = init_device_mesh(device_type, self.dims.mesh_shape, mesh_dim_names=MESH_DIM_NAMES)
        self.lightning_module._device_mesh = self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data-parallel replicas and this rank's index among them (tp/pp peers read the same data)."""
        return {"num_replicas": self.dims.dp, "rank": dp_rank(self.device_mesh)}

    def setup(self, trainer: pl.Trainer) -> None:
        """Move the model, apply the parallel plan once, then build optimisers on the wrapped parameters."""
        self.accelerator.setup(trainer)
        task = self.lightning_module
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if not self._parallelised:  # once per Trainer: fit, then test on the same model
            if self.pipeline is not None:
                task.net, self.pipeline.pipeline = build_pipeline(
                    task.net, self.device_mesh, self.dims, self.parallel, self.root_device, self.pipeline.loss_fn,
                    self.pipeline.example_input,
                )
            else:
                task.net = apply_parallelism(
                    task.net, self.device_mesh, self.dims, self.parallel, self.root_device, self.precision,
                    self.sync_batchnorm, self.comm, self.comm_counter, self.comm_state, self.compile,
                )
            self._parallelised = True
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        """Buffers that a training forward may read agree before every training batch, as DDP makes them (FSDP
        and pipeline stages do not); see ``disttrain.parallel.buffers``."""
        net = self.lightning_module.net
        if self._step_broadcast is None:
            self._step_broadcast = not isinstance(net, DistributedDataParallel) and step_broadcast_needed(net)
        if self._step_broadcast:
            self._broadcast_buffers()

    def on_validation_start(self) -> None:
        """All ranks evaluate with the same buffers (the first data-parallel rank's, as DDP keeps them)."""
        self._broadcast_buffers()

    def on_test_start(self) -> None:
        """As ``on_validation_start``."""
        self._broadcast_buffers()

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model's (sharded) state with buffers made equal first, so a checkpoint holds what ranks used."""
        self._broadcast_buffers()
        return super().lightning_module_state_dict()

    def _broadcast_buffers(self) -> None:
        if self.dims.dp_enabled:
            broadcast_buffers(self.lightning_module.net, self.dims.dp_mesh(self.device_mesh).get_group())

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip the gradient all-reduce on accumulation micro-batches (only the last one syncs); ZeRO-2/3 with
        sharded accumulation still reduce-scatter every micro-batch (``parallel.accumulate_grads``)."""
        with backward_sync_disabled(self.lightning_module.net, self.parallel.sharded_accumulation):
            yield

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """ZeRO-1: spread the optimiser state over the sharding ranks; a parameter server: over its servers;
        other layouts keep ``optimizer``."""
        group = self.device_mesh["dp_replicate"].get_group()
        if self.parallel.servers and self.parallel.staleness:
            names = {id(p): name for name, p in self.lightning_module.named_parameters()}
            return AsyncParameterServerOptimizer(optimizer, group, self.parallel.servers, self.comm_counter,
                                                 self.parallel.staleness, names)
        if self.parallel.servers:
            return ParameterServerOptimizer(optimizer, group, self.parallel.servers, self.comm_counter)
        if self.parallel.zero_stage != 1:
            return optimizer
        return shard_optimizer_state(optimizer, self.device_mesh["dp_shard"].get_group())

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """State keyed by parameter name under every layout: sharded (DTensor) for FSDP, whole otherwise."""
        inner = getattr(optimizer, "_optimizer", optimizer)  # unwrap Lightning's LightningOptimizer
        if isinstance(inner, AsyncParameterServerOptimizer):
            return inner.checkpoint_state()
        if isinstance(inner, ParameterServerOptimizer):  # each server's state of its own parameters
            inner = inner.inner_with_current_hyperparameters()
            if inner is None:
                return {}
        if isinstance(inner, ZeroRedundancyOptimizer):
            return zero1_named_state_dict(self.model, inner, FLAT_STATE)
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, inner, options=FLAT_STATE)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Write a sharded checkpoint folder beside the target, then swap it in, so a crash mid-write never
        damages the previous checkpoint at ``filepath``. With ``async_save`` the shards are staged in memory
        and written in the background; the swap happens when the next save begins or fit ends."""
        import time

        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import DefaultSavePlanner

        started = time.perf_counter()
        path = Path(self.broadcast(str(filepath)))
        self.wait_for_checkpoint()  # one save in flight
        staging = path.with_name(path.name + ".partial")
        if self.is_global_zero:
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
        self.barrier()
        shards = {"state_dict": checkpoint.pop("state_dict"),
                  **{f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))}}
        if self.replicas_differ:  # each rank's state under its own key
            shards = {f"replica{self.global_rank}": shards}
            checkpoint["replicas"] = self.world_size
        if self.is_global_zero:
            torch.save(checkpoint, staging / METADATA_FILE)  # loop, callback and scheduler state: small
        if self.async_save:
            if self._checkpoint_group is None:  # its own group: background writes never interleave with training's
                self._checkpoint_group = torch.distributed.new_group(backend="gloo")
            # the save plan is the same at every save of a run: cached, the planning collective runs once
            future = dcp.async_save(shards, checkpoint_id=staging, process_group=self._checkpoint_group,
                                    planner=DefaultSavePlanner(enable_plan_caching=True))
            self._pending_save = (future, staging, path)
        else:
            dcp.save(shards, checkpoint_id=staging)
            self._swap_in(staging, path)
        self.checkpoint_saves += 1
        self.checkpoint_blocking_s += time.perf_counter() - started

    def wait_for_checkpoint(self) -> None:
        """Finish the save in flight, if any, and swap it into place (every rank calls this at the same point)."""
        if self._pending_save is None:
            return
        future, staging, path = self._pending_save
        self._pending_save = None
        future.result()
        self._swap_in(staging, path)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Lightning's removal of a superseded checkpoint, after the save in flight has landed."""
        self.wait_for_checkpoint()
        super().remove_checkpoint(filepath)

    def _swap_in(self, staging: Path, path: Path) -> None:
        self.barrier()
        if self.is_global_zero:
            retired = path.with_name(path.name + ".old")
            if path.exists():
                path.rename(retired)
            staging.rename(path)
            if retired.exists():
                shutil.rmtree(retired) if retired.is_dir() else retired.unlink()
        self.barrier()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load model and optimiser shards into the already-parallelised model (any world size)."""
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = Path(self.broadcast(str(checkpoint_path)))
        metadata = load_metadata(path)
        state: dict[str, Any] = {"state_dict": get_model_state_dict(self.model)}
        optimizers = [o.inner if type(o) is ParameterServerOptimizer else o for o in self.optimizers]
        for idx, optimizer in enumerate(optimizers):
            if isinstance(optimizer, AsyncParameterServerOptimizer):
                state[f"optimizer_{idx}"] = optimizer.checkpoint_state()
            elif optimizer is None:  # a rank that serves no parameter holds no optimiser state
                state[f"optimizer_{idx}"] = {}
            elif isinstance(optimizer, ZeroRedundancyOptimizer):
                state[f"optimizer_{idx}"] = zero1_named_template(self.model, optimizer, FLAT_STATE)
            else:
                state[f"optimizer_{idx}"] = get_optimizer_state_dict(self.model, optimizer, options=FLAT_STATE)
        if self.replicas_differ:
            load_sharded({f"replica{self.global_rank % metadata.get('replicas', 1)}": state}, path)
        else:
            load_sharded(state, path)
        set_model_state_dict(self.model, state["state_dict"])
        for idx, optimizer in enumerate(optimizers):
            if optimizer is None or isinstance(optimizer, AsyncParameterServerOptimizer):
                continue
            if isinstance(optimizer, ZeroRedundancyOptimizer):
                load_zero1_named_state_dict(self.model, optimizer, state[f"optimizer_{idx}"], FLAT_STATE)
            else:
                set_optimizer_state_dict(self.model, optimizer, state[f"optimizer_{idx}"], options=FLAT_STATE)
        for wrapper in self.optimizers:
            if isinstance(wrapper, ParameterServerOptimizer):
                wrapper.adopt_loaded_state()
        return metadata


def dp_rank(mesh: DeviceMesh) -> int:
    """This rank's index among the data-parallel ranks (replicate-major, shard-minor)."""
    return mesh.get_local_rank("dp_replicate") * mesh["dp_shard"].size() + mesh.get_local_rank("dp_shard")
