"""Plain functions that apply parallelism to a model over a mesh, in one fixed order.

Order: tensor parallelism, expert parallelism, activation checkpointing, compilation, then either FSDP2 sharding
(ZeRO-2/3, hybrid sharding; experts over their own ranks), DDP replication (plain data parallelism and ZeRO-1, whose
optimiser state is sharded by the strategy) or replicas whose exchange is not DDP's (Local SGD and DiLoCo between
outer steps, a parameter server in the optimiser step).
"""

from __future__ import annotations

import inspect
from collections.abc import Generator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.nn.parallel import DistributedDataParallel

from disttrain.comm.config import CommConfig
from disttrain.comm.counter import ByteCounter
from disttrain.comm.hooks import register_compression, wire_dtype
from disttrain.comm.state import ExchangeState
from disttrain.parallel.activation_checkpoint import apply_activation_checkpointing
from disttrain.parallel.buffers import step_broadcast_needed
from disttrain.parallel.compile import Compilation, compile_model
from disttrain.parallel.config import DDPOptions, ParallelConfig
from disttrain.parallel.experts import apply_expert_parallel
from disttrain.parallel.fsdp import apply_fsdp, mixed_precision_policy, set_gradient_sync
from disttrain.parallel.layout import Layout
from disttrain.parallel.local_sgd import broadcast_module
from disttrain.parallel.model_plan import shard_units_of, tp_plan_of
from disttrain.parallel.tp import apply_tp


def apply_parallelism(
    model: nn.Module,
    mesh: DeviceMesh,
    layout: Layout,
    device: torch.device,
    parallel: ParallelConfig | None = None,
    precision: str = "32-true",
    sync_batchnorm: bool = False,
    comm: CommConfig | None = None,
    counter: ByteCounter | None = None,
    exchange: ExchangeState | None = None,
    compilation: Compilation | None = None,
) -> nn.Module:
    """Lay ``model`` out as ``layout`` says (``model`` is already split by sequence under context parallelism, see
    ``disttrain.parallel.context``); returns the module to train (maybe a wrapper, ``layout.wrapper``).
    ``parallel``: the config's model-plan overrides (tp_plan, shard_units, min_params_per_unit) and DDP's options
    (None: the defaults); what the layout decides is read from ``layout`` only. ``comm``: what data-parallel
    gradients are sent as, with the bytes counted in ``counter`` and what carries over between steps kept in
    ``exchange``. ``compilation``: torch.compile each unit or the whole model, in its mode, as it says
    (``compiled_regions``); None: eager."""
    parallel = parallel or ParallelConfig()
    if layout.tp_enabled:
        apply_tp(model, mesh["tp"], tp_plan_of(model, parallel.tp_plan), layout.sequence_parallel)
    experts = apply_expert_parallel(model, layout.expert_meshes(mesh)[0]) if layout.ep_enabled else []
    units = shard_units_of(model, parallel.shard_units, parallel.min_params_per_unit)
    if layout.activation_checkpoint != "none":
        apply_activation_checkpointing(model, units, layout.activation_checkpoint, layout.checkpoint_every_n_blocks)
    if compilation is not None:
        compile_model(model, units, compilation)
    wrapper = layout.wrapper
    if wrapper == "fsdp":
        return apply_fsdp(
            model,
            layout.shard_mesh(mesh),
            reshard_after_forward=layout.reshards_after_forward,
            mp_policy=mixed_precision_policy(precision, device.type, wire_dtype(comm)),
            offload_policy=CPUOffloadPolicy() if layout.cpu_offload else None,
            units=units,
            experts=experts,
            expert_mesh=layout.expert_meshes(mesh)[1] if experts else None,
        )
    if wrapper == "ddp":  # data-parallel ranks, and context-parallel ones averaging their slices' gradients
        dp_mesh = layout.gradient_mesh(mesh)
        if sync_batchnorm:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model, dp_mesh.get_group())
        ddp = apply_ddp(model, dp_mesh, parallel.ddp, device)
        if comm is not None:
            register_compression(ddp, comm, counter or ByteCounter(), exchange or ExchangeState())
        return ddp
    if wrapper == "none" and layout.dp_enabled:  # replicas whose kind of run exchanges updates: they start equal
        broadcast_module(model, layout.dp_mesh(mesh).get_group())
    return model


def apply_ddp(model: nn.Module, dp_mesh: DeviceMesh, options: DDPOptions, device: torch.device
              ) -> DistributedDataParallel:
    """Replicate ``model`` over ``dp_mesh`` with torch DDP (bucketed, overlapped gradient all-reduce)."""
    return DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        process_group=dp_mesh.get_group(),
        bucket_cap_mb=options.bucket_cap_mb,
        gradient_as_bucket_view=options.gradient_as_bucket_view,
        static_graph=options.static_graph,
        find_unused_parameters=options.find_unused_parameters,
        **buffer_sync_option(step_broadcast_needed(model, options.forward_sync_buffers)),
    )


def buffer_sync_option(every_step: bool) -> dict[str, bool]:
    """DDP's keyword for copying buffers from the first rank before every forward (buffers are copied once at
    construction either way, on torch >= 2.13; earlier versions skip that too when the per-step copy is off)."""
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": every_step}
    return {"broadcast_buffers": every_step}  # its name before torch 2.13


@contextmanager
def backward_sync_disabled(model: nn.Module, sharded: bool = False) -> Generator[None, None, None]:
    """Within this context backward passes accumulate gradients without the step's exchange: locally and whole
    (DDP; FSDP2 unless ``sharded``) or, with ``sharded`` (``Layout.sharded_accumulation``), reduce-
    scattered into FSDP2's gradient shards every micro-batch, with only hybrid sharding's all-reduce deferred."""
    set_gradient_sync(model, False, sharded)
    try:
        yield
    finally:
        set_gradient_sync(model, True, sharded)
