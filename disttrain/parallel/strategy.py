"""The one Lightning strategy of disttrain: it owns the DeviceMesh and applies parallelism to the model.

It derives from Lightning's ``ModelParallelStrategy`` (the only Lightning strategy that runs FSDP2 and
DTensor on a CPU/gloo mesh) and replaces its 2-D mesh with the 5-D ``pp x dp_replicate x dp_shard x cp x tp``
mesh, applies the plan itself (no ``configure_model`` hook needed in the task), and writes checkpoints
as sharded folders that replace the previous one atomically.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.nn.parallel import DistributedDataParallel

from disttrain.checkpoint.optimizer_state import optimizer_state
from disttrain.checkpoint.sharded import SameStateAs, ShardedCheckpoints
from disttrain.comm.config import CommConfig
from disttrain.comm.counter import ByteCounter
from disttrain.comm.state import ExchangeState
from disttrain.lightning_internals import join_process_group, optimizers_to_device, set_device_mesh
from disttrain.models.lora import initial_adapter_sources
from disttrain.models.nf4 import quantise_adapted_bases
from disttrain.parallel.apply import backward_sync_disabled
from disttrain.parallel.buffers import broadcast_buffers, step_broadcast_needed
from disttrain.parallel.compile import Compilation
from disttrain.parallel.config import ParallelConfig
from disttrain.parallel.context import SequenceSplit, sequence_split_of
from disttrain.parallel.dims import MESH_DIM_NAMES
from disttrain.parallel.float8 import Float8Layers
from disttrain.parallel.lay_out import lay_out
from disttrain.parallel.layout import Layout
from disttrain.parallel.pipeline.runtime import PipelineSlot
from disttrain.parallel.pretrained import load_pretrained

OptimizerWrap = Callable[[torch.optim.Optimizer, "DistTrainStrategy"], torch.optim.Optimizer]
"""How a kind of run wraps the task's optimiser, given the strategy (its mesh, byte counter and module)."""

InMemoryCheckpoint = Callable[[Any, torch.nn.Module, list[torch.optim.Optimizer]], "dict[str, Any] | None"]
"""Given the path a fit resumes from, the laid-out model and the optimisers: where the path names a state held in
memory (a live replica group's), load it into them and return the rest of the checkpoint; None: a file to read."""


@dataclass(frozen=True)
class StrategyHooks:
    """What a kind of run hands the strategy when it is built (``RunKind.strategy_hooks``); the defaults are a
    synchronous run's. The strategy asks a hook when it needs it, so a value that exists only later (the state a
    restarted replica group receives) is a callable here."""

    pipeline: PipelineSlot | None = None
    """Where a pipelined run's stages and schedule go (shared with the task); None: not pipelined."""
    wrap_optimizer: OptimizerWrap | None = None
    """How the kind wraps the task's optimiser (ZeRO-1's sharded state, a parameter server); None: as built."""
    per_replica_checkpoints: bool = False
    """Replicas hold different parameters between exchanges: a checkpoint keeps every rank's own."""
    replica_slot: tuple[int, int] | None = None
    """``(group, groups)`` of torchft replica groups: the group trains on its fixed slot of the data (None: the
    mesh's data-parallel ranks are all there is)."""
    checkpoint_gate: Callable[[], bool] | None = None
    """Whether this Trainer writes (and prunes) checkpoints now (None: always); one replica group does."""
    in_memory_checkpoint: InMemoryCheckpoint | None = None
    """A state to resume from instead of a file, asked at every load (None: checkpoints are files)."""


class DistTrainStrategy(ModelParallelStrategy):
    """Builds the mesh of ``layout`` and lays the task's ``net`` out as it says before optimisers exist; ``parallel``
    gives what the layout does not decide (process-group backend and timeout, DDP's and the pipeline schedule's
    options, the model-plan overrides)."""

    def __init__(
        self, layout: Layout, parallel: ParallelConfig, precision: str = "32-true", sync_batchnorm: bool = False,
        async_save: bool = False, comm: CommConfig | None = None, compilation: Compilation | None = None,
        hooks: StrategyHooks = StrategyHooks(), float8: Float8Layers | None = None,
    ) -> None:
        super().__init__(
            data_parallel_size=layout.dp,
            tensor_parallel_size=layout.tp,
            save_distributed_checkpoint=True,
            process_group_backend=parallel.backend,
            timeout=timedelta(seconds=parallel.timeout_s),
        )
        self.layout = layout
        """The run's degrees and where its state lives (``disttrain.parallel.layout``)."""
        self.parallel = parallel
        self.precision = precision
        self.sync_batchnorm = sync_batchnorm
        self.hooks = hooks
        """What the kind of run hands the strategy (``StrategyHooks``)."""
        self.comm = comm
        """What DDP's gradients are sent as (None: DDP's own fp32 all-reduce)."""
        self.compilation = compilation
        """How the model is compiled once its layout is applied (its mode and scope); None: eager."""
        self.float8 = float8
        """The linear layers trained in float8 (None: none)."""
        self.comm_counter = ByteCounter()
        """Bytes this rank sent through disttrain's gradient exchange."""
        self.comm_state = ExchangeState()
        """What this rank's gradient exchange carries between steps (residuals, PowerSGD's factors)."""
        self.checkpoints = ShardedCheckpoints(self, async_save, hooks.per_replica_checkpoints)
        """This Trainer's checkpoint writer and reader (with the count and blocking time of its saves)."""
        self._parallelised = False
        self._step_broadcast: bool | None = None
        """Whether buffers are broadcast before each training batch (decided at the first one)."""
        self.sequence_split: SequenceSplit | None = None
        """This rank's slice of every sequence under context parallelism (None: whole sequences)."""
        self._linked_state: SameStateAs | None = None
        """The checkpoint whose shards the save under way links, within ``linking_state`` (None: it writes its own)."""

    def setup_environment(self) -> None:
        """Join the process group (or reuse the launcher's) and build the named 5-D mesh."""
        join_process_group(self)
        device_type = self.root_device.type
        set_device_mesh(self, self.lightning_module,
                        init_device_mesh(device_type, self.layout.mesh_shape, mesh_dim_names=MESH_DIM_NAMES))
        if self.layout.cp_enabled:
            self.sequence_split = sequence_split_of(self.device_mesh)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Data-parallel replicas and this rank's index among them (tp/pp peers read the same data)."""
        return {"num_replicas": self.layout.dp, "rank": dp_rank(self.device_mesh)}

    @property
    def train_sampler_kwargs(self) -> dict[str, Any]:
        """As ``distributed_sampler_kwargs`` for training data; replica groups each read their own slot of it
        (evaluation stays within a group: every group evaluates the whole set)."""
        kwargs = self.distributed_sampler_kwargs
        if self.hooks.replica_slot is None:
            return kwargs
        group, groups = self.hooks.replica_slot
        return {"num_replicas": groups * kwargs["num_replicas"], "rank": group * kwargs["num_replicas"] +
                kwargs["rank"]}

    def setup(self, trainer: pl.Trainer) -> None:
        """Move the model, apply the parallel plan once, then build optimisers on the wrapped parameters."""
        self.accelerator.setup(trainer)
        task = self.lightning_module
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if not self._parallelised:  # once per Trainer: fit, then test on the same model
            starting_weights = getattr(task.net, "pretrained", None)
            folder = starting_weights() if callable(starting_weights) else None
            # taken from the whole model: a pipeline stage keeps only its own modules
            converting = getattr(task.net, "pretrained_conversion", None)
            conversion = converting() if folder is not None and callable(converting) else None
            adapters = initial_adapter_sources(task.net) if folder is not None else None
            materialize = getattr(task.net, "materialize", None) if _on_meta(task.net) else None
            task.net = lay_out(task.net, self.device_mesh, self.layout, self.parallel, self.root_device,
                               materialize, self.sequence_split, self.hooks.pipeline, self.float8,
                               precision=self.precision,
                               sync_batchnorm=self.sync_batchnorm, comm=self.comm, counter=self.comm_counter,
                               exchange=self.comm_state, compilation=self.compilation)
            if folder is not None:
                load_pretrained(task.net, folder, conversion, adapters)
            # QLoRA's base (model.lora.base_dtype=nf4) is quantised once its weights are final, on one process or
            # under DDP (whose reducer holds the adapters alone, so the frozen layers it wraps may change)
            quantise_adapted_bases(task.net)
            self._parallelised = True
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """Under context parallelism, this rank's slice of every sequence of the batch (inputs and targets alike)
        is all that moves to its device."""
        if self.sequence_split is not None:
            batch = type(batch)(self.sequence_split.split(part) for part in batch)
        target = device or self.root_device
        if isinstance(batch, tuple | list) and all(isinstance(part, torch.Tensor) and part.device == target
                                                   for part in batch):
            # already there: Lightning's transfer walks the batch and calls three hooks that disttrain's task
            # and data modules do not override (which a small CNN's step on the CPU feels)
            return batch
        return super().batch_to_device(batch, device, dataloader_idx)

    def model_to_device(self) -> None:
        """Lightning's move to this rank's device, leaving a model still on the meta device where it is (it is
        allocated on the device once laid out, see ``setup``)."""
        self.model._apply(lambda t: t if t.is_meta else t.to(self.root_device))

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
        """The model's (sharded) state with buffers made equal first, so a checkpoint holds what ranks used; none
        while a save links the state's shards from a checkpoint of the same step (``linking_state``)."""
        if self._linked_state is not None:
            return {}
        self._broadcast_buffers()
        return super().lightning_module_state_dict()

    @contextmanager
    def linking_state(self, same_state_as: SameStateAs) -> Generator[None, None, None]:
        """Within it, a save takes its model and optimiser state from ``same_state_as``'s shards (hard links): Lightning
        gathers no state for it (a quarter of a small run's checkpointing time went into gathering it again)."""
        self._linked_state = same_state_as
        try:
            yield
        finally:
            self._linked_state = None

    def _broadcast_buffers(self) -> None:
        if self.layout.gradient_ranks > 1:
            broadcast_buffers(self.lightning_module.net, self.layout.gradient_mesh(self.device_mesh).get_group())

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skip the gradient all-reduce on accumulation micro-batches (only the last one syncs); ZeRO-2/3 with
        sharded accumulation still reduce-scatter every micro-batch (``parallel.accumulate_grads``)."""
        with backward_sync_disabled(self.lightning_module.net, self.layout.sharded_accumulation):
            yield

    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimiser as the kind of run wraps it (ZeRO-1's sharded state, a parameter server), else itself."""
        wrap = self.hooks.wrap_optimizer
        return wrap(optimizer, self) if wrap is not None else optimizer

    def optimizer_step(self, optimizer: torch.optim.Optimizer, closure: Callable[[], Any],
                       model: pl.LightningModule | torch.nn.Module | None = None, **kwargs: Any) -> Any:
        """Lightning's step (every kind of run's, automatic or by hand), then what the float8 layers take from the
        new weights once per step (``Float8Layers.after_optimizer_step``). A step its closure skips raises before
        it and leaves the weights, and what was taken from them, as they were."""
        stepped = super().optimizer_step(optimizer, closure, model, **kwargs)
        if self.float8 is not None:
            self.float8.after_optimizer_step(self.lightning_module.net)
        return stepped

    def weights_replaced(self) -> None:
        """Called once a load has replaced the model's weights other than by an optimiser step: what was taken from
        the weights before is dropped (``Float8Layers.after_weights_replaced``)."""
        if self.float8 is not None:
            self.float8.after_weights_replaced(self.lightning_module.net)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """State keyed by parameter name under every layout: sharded (DTensor) for FSDP, whole otherwise; none while
        a save links it (``linking_state``)."""
        return {} if self._linked_state is not None else optimizer_state(self.model, optimizer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """A sharded folder swapped in whole (``disttrain.checkpoint.sharded``); within ``linking_state``, its
        shards are links to the checkpoint that already holds them."""
        if self.writes_checkpoints():
            self.checkpoints.save(checkpoint, filepath, self._linked_state)

    def writes_checkpoints(self) -> bool:
        """Whether this Trainer writes (and prunes) checkpoints now: always, unless the kind gates it."""
        return self.hooks.checkpoint_gate is None or self.hooks.checkpoint_gate()

    def wait_for_checkpoint(self) -> None:
        """Finish the save in flight, if any (every rank calls this at the same point)."""
        self.checkpoints.wait()

    def remove_checkpoint(self, filepath: Any) -> None:
        """Lightning's removal of a superseded checkpoint, after the save in flight has landed."""
        self.checkpoints.wait()
        if self.writes_checkpoints():
            super().remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load model and optimiser shards into the already-parallelised model (any world size); the model's alone
        outside fit (the end-of-run test of the best checkpoint), which restores no optimiser state."""
        in_memory = self.hooks.in_memory_checkpoint
        loaded = in_memory(checkpoint_path, self.model, self.optimizers) if in_memory is not None else None
        if loaded is None:
            # outside fit the optimiser's AdamW moments and its hundreds of small entries are neither read nor
            # planned, most of a test's checkpoint load (benchmarks/README.md, Figures cited elsewhere)
            fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
            loaded = self.checkpoints.load(checkpoint_path, self.model, self.optimizers if fitting else [])
        # the test of the best checkpoint after fit loads it into weights that took the last step's scales
        self.weights_replaced()
        return loaded


def dp_rank(mesh: DeviceMesh) -> int:
    """This rank's index among the data-parallel ranks (replicate-major, shard-minor)."""
    return mesh.get_local_rank("dp_replicate") * mesh["dp_shard"].size() + mesh.get_local_rank("dp_shard")


def _on_meta(net: torch.nn.Module) -> bool:
    """Whether ``net`` was built on the meta device (its weights come from a checkpoint once it is laid out)."""
    return any(p.is_meta for p in net.parameters())
