"""Pipeline parallelism inside the runner: build this rank's stages and run a schedule in a training step.

Lightning's automatic loop zeroes gradients between ``training_step`` and ``backward``, while a pipeline
schedule runs forward and backward inside one call; the pipelined task therefore uses Lightning's manual
optimisation and does accumulation, global-norm clipping and the optimiser step itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage

from disttrain.loss import token_cross_entropy
from disttrain.models.documents import documents_of
from disttrain.observe.phases import PHASE_MARKS
from disttrain.parallel.activation_checkpoint import apply_activation_checkpointing, checkpointed_blocks
from disttrain.parallel.config import ParallelConfig
from disttrain.parallel.experts import apply_expert_parallel
from disttrain.parallel.fsdp import apply_fsdp
from disttrain.parallel.layout import Layout
from disttrain.parallel.model_plan import pipeline_units_of, shard_units_of, tp_plan_of
from disttrain.parallel.pipeline.documents import DocumentStage, MicroBatchDocuments, split_of
from disttrain.parallel.pipeline.phases import PhaseLoss, PhaseStage
from disttrain.parallel.pipeline.split import (
    UnitStage,
    build_schedule,
    build_stage_module,
    placement,
    stage_indices,
    unit_split_points,
)
from disttrain.parallel.pipeline.timeline import ActionRecorder, records_on
from disttrain.parallel.tp import apply_tp


@dataclass
class Pipeline:
    """This rank's part of a pipeline: its schedule and whether it holds the first and the last stage."""

    schedule: Any
    """The ``torch.distributed.pipelining`` schedule over this rank's stages."""
    has_first: bool
    """This rank holds the first stage (it is fed the inputs)."""
    has_last: bool
    """This rank holds the last stage (it computes the losses)."""
    pp_group: dist.ProcessGroup
    """The ranks of this pipeline."""
    losses: list[torch.Tensor] = field(default_factory=list)
    """The last stage's microbatch losses of the current batch."""
    recorder: ActionRecorder | None = None
    """Times the actions of a recorded step (``pipeline.timeline``, on the pipeline of global rank 0)."""
    documents: MicroBatchDocuments | None = None
    """The document ids of each micro-batch, for a model whose windows are packed documents (None: not packed)."""
    stages: list[PipelineStage] = field(default_factory=list)
    """This rank's stages, in schedule order (``mode=dryrun`` runs their modules without the schedule)."""
    stage_inputs: list[torch.Tensor] = field(default_factory=list)
    """The input of one microbatch for each of ``stages``, on the meta device (its shape and dtype)."""

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, train: bool,
            record: bool = False) -> tuple[torch.Tensor, Any] | None:
        """One step (train) or forward-only pass of the schedule over the batch; on the last stage the summed
        microbatch losses and the merged outputs, None elsewhere. ``record``: time this training step's
        actions (where the pipeline has a recorder)."""
        self.losses.clear()
        if self.documents is not None:  # every rank is handed the inputs: each stage masks its micro-batch's
            self.documents.read(inputs)
        args = (inputs,) if self.has_first else ()
        kwargs = {"target": targets, "losses": self.losses} if self.has_last else {}
        if train and record and self.recorder is not None:
            with self.recorder.recording(), PHASE_MARKS.schedule_step():
                outputs = self.schedule.step(*args, **kwargs)
        elif train:
            with PHASE_MARKS.schedule_step():
                outputs = self.schedule.step(*args, **kwargs)
        else:
            with forward_only(self.schedule):
                outputs = self.schedule.eval(*args, **kwargs)
        return (torch.stack(self.losses).sum(), outputs) if self.has_last else None


@dataclass
class PipelineSlot:
    """What a pipelined run shares between the strategy, which builds the stages and the schedule into it
    at set-up, and the task, which runs it each step: neither reaches into the other."""

    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """Loss of one microbatch on the last stage (see ``scaled_cross_entropy``)."""
    example_input: torch.Tensor
    """A zero-valued input of one microbatch's shape, for the stages' set-up."""
    pipeline: Pipeline | None = None
    """This rank's part, once the strategy has built it."""

    def run(self, inputs: torch.Tensor, targets: torch.Tensor, train: bool,
            record: bool = False) -> tuple[torch.Tensor, Any] | None:
        """``Pipeline.run`` of the built pipeline."""
        if self.pipeline is None:
            raise RuntimeError("the pipeline is built by the strategy's setup, which has not run")
        return self.pipeline.run(inputs, targets, train, record)


def scaled_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, divisor: int) -> torch.Tensor:
    """Microbatch cross-entropy summed over its targets / (their count x ``divisor``): with ``divisor`` =
    microbatches x accumulation the summed gradients are those of the step's mean (evaluation padding,
    ``IGNORE_INDEX``, adds nothing to the sum)."""
    return token_cross_entropy(logits, targets, "sum") / (targets.numel() * divisor)


BACKWARD_ACTIONS = frozenset({"B", "I", "W", "OVERLAP_F_B", "SEND_B", "RECV_B", "REDUCE_GRAD"})
"""Action types of torch's multi-stage schedules that belong to the backward pass."""


@contextmanager
def forward_only(schedule: Any) -> Iterator[None]:
    """Run a multi-stage schedule's actions without the backward ones (evaluation).

    torch's ``eval`` keeps every action and only marks stages as having no backward, which the ZBV
    schedule's local backward hand-over between the two stages of the last rank refuses. Keeping each
    rank's forward actions in their order cannot deadlock where the whole schedule did not.
    """
    # the runtime schedules (interleaved, zero bubble, ZBV) run the order with communication actions added
    saved = {name: getattr(schedule, name) for name in ("pipeline_order", "pipeline_order_with_comms")
             if getattr(schedule, name, None)}
    for name, order in saved.items():
        setattr(schedule, name, {rank: [a for a in actions if a is None or a.computation_type not in BACKWARD_ACTIONS]
                                 for rank, actions in order.items()})
    try:
        yield
    finally:
        for name, order in saved.items():
            setattr(schedule, name, order)


def build_pipeline(
    model: nn.Module,
    mesh: DeviceMesh,
    layout: Layout,
    parallel: ParallelConfig,
    device: torch.device,
    loss_fn: Any,
    example_input: torch.Tensor,
) -> tuple[nn.Module, Pipeline]:
    """Cut ``model`` into stages, keep this rank's (tensor-parallel over tp, its blocks checkpointed as the layout
    says, sharded over dp_shard x cp under ZeRO-2/3), and build the schedule ``parallel.pipeline`` names (the config
    gives also the model-plan overrides). Returns a module holding exactly this rank's parameters under the full
    model's names (so checkpoints of all stages merge into one), and the pipeline that runs them."""
    options = parallel.pipeline
    num_stages = layout.pp * options.stages_per_rank
    units = pipeline_units_of(model, parallel.pipeline_units)
    points = unit_split_points(model, units, num_stages, options.split_points)
    pp_rank = mesh.get_local_rank("pp")
    indices = stage_indices(pp_rank, layout.pp, options.stages_per_rank, placement(options.schedule))
    every_stage = [build_stage_module(model, units, i, points).to(device) for i in range(num_stages)]
    documents = documents_of(model)
    if documents is not None:  # the stages' example pass attends within the example's documents
        documents.read(example_input.to(device), split_of(model))
    examples = stage_examples(every_stage, example_input.to(device))
    modules = [every_stage[i] for i in indices]
    if layout.tp_enabled:  # stages exchange whole activations: no sequence parallelism across a stage boundary
        plan = tp_plan_of(model, parallel.tp_plan)
        for module in modules:
            apply_tp(module, mesh["tp"], plan, sequence_parallel=False)
    experts = [apply_expert_parallel(module, layout.expert_meshes(mesh)[0]) if layout.ep_enabled else []
               for module in modules]
    checkpoint_stage_blocks(model, modules, layout, parallel)
    if layout.shards_parameters:
        for module, held in zip(modules, experts, strict=True):
            # one FSDP unit per stage root (per-block units broke interleaved zero bubble), and one per experts'
            # module, which shards over other ranks
            apply_fsdp(module, layout.shard_mesh(mesh), reshard_after_forward=layout.reshards_after_forward,
                       units=[], experts=held, expert_mesh=layout.expert_meshes(mesh)[1] if held else None)
    pp_group = mesh["pp"].get_group()
    chunks = None if documents is None else MicroBatchDocuments(documents, split_of(model), options.microbatches)
    # the stages and the loss mark the step's phases for the straggler detector (disttrain.observe.phases)
    stage_class = PhaseStage if chunks is None else partial(DocumentStage, micro_batch_documents=chunks)
    stages = [stage_class(m, i, num_stages, device, input_args=(examples[i],), output_args=(examples[i + 1],),
                          group=pp_group) for m, i in zip(modules, indices, strict=True)]
    # Gradients are scaled by the loss function (1 / microbatches / accumulation), not by the schedule,
    # whose scaling would also divide gradients accumulated over earlier batches.
    schedule = build_schedule(options.schedule, stages, options.microbatches, PhaseLoss(loss_fn), scale_grads=False)
    owned = UnitStage(model, [name for m in modules for name in m.unit_names])
    recorder = ActionRecorder(stages, schedule=options.schedule, microbatches=options.microbatches,
                              num_stages=num_stages, pp=layout.pp) \
        if options.timeline and records_on(pp_group) else None
    return owned, Pipeline(schedule, 0 in indices, num_stages - 1 in indices, pp_group, recorder=recorder,
                           documents=chunks, stages=stages,
                           stage_inputs=[examples[i].detach().to("meta") for i in indices])


def checkpoint_stage_blocks(model: nn.Module, stages: list[nn.Module], layout: Layout,
                            parallel: ParallelConfig | None = None) -> None:
    """Checkpoint the blocks of ``model`` that lie in ``stages`` as ``layout`` says (the blocks: the shard units of
    ``parallel``'s overrides, None: the model's own); every n-th block is counted over the whole model, so a block
    is checkpointed or not whatever stage it lands on."""
    if layout.activation_checkpoint == "none":
        return
    parallel = parallel or ParallelConfig()
    units = shard_units_of(model, parallel.shard_units, parallel.min_params_per_unit)
    held = {id(m) for stage in stages for m in stage.modules()}
    mine = [block for block in checkpointed_blocks(units, layout.checkpoint_every_n_blocks) if id(block) in held]
    if mine:  # a stage of only the embedding or the head has no block
        apply_activation_checkpointing(model, mine, layout.activation_checkpoint)


def stage_examples(stages: list[nn.Module], first_input: torch.Tensor) -> list[torch.Tensor]:
    """Input of every stage and output of the last for one microbatch, from one pass in eval mode.

    Given to ``PipelineStage`` as example inputs and outputs, they replace its first-step shape inference,
    which runs stages on uninitialised buffers and would poison BatchNorm running statistics.
    """
    examples = [first_input]
    for stage in stages:
        training = stage.training
        stage.eval()
        output = stage(examples[-1]).detach()
        stage.train(training)
        examples.append(output.requires_grad_(output.is_floating_point()))
    return examples
