"""How a run executes, decided once during validation: its kind and what the Trainer and the task are told."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from disttrain.config.batch import ResolvedBatch
from disttrain.config.schema import TrainerConfig
from disttrain.parallel.config import ParallelConfig
from disttrain.parallel.dims import ParallelDims


@dataclass(frozen=True)
class ExecutionPlan:
    """How a run executes, decided once during validation (the runner and the strategy only read it)."""

    kind: str
    """The kind of run (one of ``RUN_KINDS``): how updates are exchanged, and so which task, optimiser wrap,
    callbacks and results sections the rank builds (``disttrain.rank.kinds``)."""
    trainer_accumulation: int
    """Lightning's ``accumulate_grad_batches`` (1 when the task accumulates itself)."""
    trainer_clip: float | None
    """Lightning's ``gradient_clip_val`` (None when the task clips itself)."""
    inference_mode: bool
    """Evaluate under ``torch.inference_mode`` (not for pipeline stages, whose activations autograd tracks)."""
    full_eval_batches: bool
    """Pad evaluation to whole batches on every rank (pipeline stages need one batch shape throughout)."""
    microbatch_shape: tuple[int, ...] = ()
    """Shape of one pipeline microbatch's input (pipelined runs)."""
    microbatch_dtype: str = "float32"
    """Its dtype: int64 for token ids, float32 for images."""
    loss_divisor: int = 1
    """Forward passes per optimiser step on a rank (accumulation micro-batches x pipeline microbatches): each
    one's loss enters the step's gradient divided by it (a pipelined microbatch's loss function divides by it,
    Lightning divides for accumulation, a model's auxiliary losses are scaled by it)."""
    loss_ranks: int = 1
    """Ranks that hold the last stage's losses (data-parallel x context-parallel x tensor-parallel)."""
    loss_mean: str = "batch"
    """What a training step's loss is the mean over (one of ``LOSS_MEANS``): "batch", each
    micro-batch's own targets (every target is real, so the mean of equal micro-batches' means is the step's);
    "step", every real target of the step's whole batch (the data masks targets and the ranks' gradients are
    averaged every step); "replica", every real target of this rank's batches of the step (replicas that step on
    their own gradients)."""


LOSS_MEANS = ("batch", "step", "replica")
"""What a training step's loss may be the mean over (``ExecutionPlan.loss_mean``; ``disttrain.rank.target_mean``)."""

RUN_KINDS = ("synchronous", "pipelined", "local_sgd", "param_server", "federated", "torchft")
"""Every kind of run, by the name ``disttrain.rank.kinds`` builds it by."""


def run_kind(parallel: ParallelConfig, dims: ParallelDims, engine: str = "restart") -> str:
    """The one decision of which kind of run this is (the rank side never asks again); ``engine``:
    ``fault_tolerance.engine`` (torchft replica groups are a kind of their own)."""
    if engine == "torchft":
        return "torchft"
    if parallel.federated:
        return "federated"
    if dims.pp_enabled:
        return "pipelined"
    if parallel.servers:
        return "param_server"
    if parallel.sync_every:
        return "local_sgd"
    return "synchronous"


def execution_plan(dims: ParallelDims, batch: ResolvedBatch, trainer: TrainerConfig, parallel: ParallelConfig,
                   spec: Any, engine: str = "restart") -> ExecutionPlan:
    """The plan for a run of these degrees, batch and data (``engine``: ``fault_tolerance.engine``)."""
    kind = run_kind(parallel, dims, engine)
    mean = loss_mean(kind, spec, parallel)
    if kind in ("federated", "torchft"):  # clients clip their own local steps; replica groups step by hand
        return ExecutionPlan(kind, batch.accumulation if kind == "federated" else 1, None, True, False,
                             loss_divisor=batch.accumulation, loss_mean=mean)
    if kind != "pipelined":
        return ExecutionPlan(kind, batch.accumulation, trainer.gradient_clip_val, True, False,
                             loss_divisor=batch.accumulation, loss_mean=mean)
    size = batch.micro_size // parallel.pipeline.microbatches
    text = spec.kind == "text"
    shape = (size, spec.block_size // dims.cp) if text else (size, spec.in_channels, spec.image_size, spec.image_size)
    return ExecutionPlan(kind, 1, None, False, True, shape, "int64" if text else "float32",
                         parallel.pipeline.microbatches * batch.accumulation, dims.dp * dims.cp * dims.tp, mean)


def loss_mean(kind: str, spec: Any, parallel: ParallelConfig) -> str:
    """``ExecutionPlan.loss_mean`` of a run of ``kind`` on data of ``spec``: where targets may be masked, the mean
    over the step's real targets wherever every step applies the gradients averaged over all ranks (synchronous
    parameter servers and torchft's replica groups too), over this rank's own where replicas step apart (Local
    SGD, asynchronous parameter servers). Federated clients' local steps take each batch's own mean already."""
    if not getattr(spec, "masked_targets", False) or kind == "federated":
        return "batch"
    apart = kind == "local_sgd" or (kind == "param_server" and parallel.staleness > 0)
    return "replica" if apart else "step"
