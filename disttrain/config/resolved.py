"""What every worker rank reads: the job's validated run, written whole, so that a rank decides nothing again.

The job validates once (``validation.validate``) and writes ``resolved.yaml`` into the run directory: every typed
group as validation left it, with its decisions in it (ranks per node, precision, the resume folder, the codec's
rank, the validation schedule, the planner's layout, ...); the run's resolved YAML (what ``config.yaml`` holds, for
people and tools); and, for each world size the run may train on (its own, and the smaller ones of
``trainer.devices=MIN:MAX`` it may restart on), the layout, batch numbers and execution plan decided for it; and
the ``model.init_weights`` file as the job checked it. A rank loads the file, type-checks each group against its
schema and takes the decisions of its world: it runs no check and makes no decision of its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import OmegaConf

from disttrain.checkpoint.init_weights import InitWeightsFile
from disttrain.config.batch import ResolvedBatch, resolve_batch
from disttrain.config.execution import ExecutionPlan, execution_plan
from disttrain.config.run import RunConfig
from disttrain.config.typed import typed, typed_groups
from disttrain.data import UserDataConfig, build_datamodule
from disttrain.errors import ConfigError
from disttrain.models.target import TargetModelConfig
from disttrain.parallel.layout import Layout

RESOLVED_FILE = "resolved.yaml"
"""In the run directory: the validated run that every worker rank reads."""


def rank_file(run: RunConfig) -> str:
    """``run`` as the text of ``resolved.yaml``: its typed groups whole, its YAML, and the decisions of every world
    size it may train on."""
    worlds = {run.layout.world_size: (run.layout, run.batch, run.plan)}
    for world in run.world_sizes:
        if world not in worlds:  # the run's own world is decided already
            worlds[world] = _decided_at(run, world)
    config = {**_node_of(run.train), "model": _node_of(run.model), "data": _node_of(run.data),
              "optim": _node_of(run.optim), "scheduler": _node_of(run.scheduler)}
    return OmegaConf.to_yaml(OmegaConf.create({
        "config": config,
        "yaml": run.yaml,
        "init_weights": dataclasses.asdict(run.init_weights) if run.init_weights is not None else None,
        "worlds": {str(world): {"layout": dataclasses.asdict(layout), "batch": dataclasses.asdict(batch),
                                "plan": dataclasses.asdict(plan)}
                   for world, (layout, batch, plan) in worlds.items()},
    }))


def load_rank_file(text: str, world: int) -> RunConfig:
    """The run a rank of a ``world``-rank job trains: ``rank_file``'s text read back and type-checked, with the
    decisions the job made for that world. ConfigError where the job decided nothing for it."""
    node = OmegaConf.create(text)
    top, model, data, optim, scheduler = typed_groups(node.config)
    decided = node.worlds.get(str(world))
    if decided is None:
        raise ConfigError("trainer.devices", world,
                          f"one of the world sizes the job validated ({', '.join(node.worlds)})")
    layout = typed(f"worlds.{world}.layout", decided.layout, Layout)
    batch = typed(f"worlds.{world}.batch", decided.batch, ResolvedBatch)
    plan = typed(f"worlds.{world}.plan", decided.plan, ExecutionPlan)
    plan = dataclasses.replace(plan, microbatch_shape=tuple(plan.microbatch_shape))
    init_weights = node.get("init_weights")
    if init_weights is not None:
        init_weights = typed("init_weights", init_weights, InitWeightsFile)
    datamodule = build_datamodule(data, micro_batch_size=batch.micro_size, seed=top.seed)
    return RunConfig(top, model, data, optim, scheduler, layout, batch, node.yaml, (), plan, datamodule,
                     init_weights=init_weights)


def _decided_at(run: RunConfig, world: int) -> tuple[Layout, ResolvedBatch, ExecutionPlan]:
    """The layout, batch and plan of ``run`` on ``world`` ranks (a world it may restart on; validation checked that
    the run fits it)."""
    top = run.train
    layout = Layout.on(top.parallel, world)
    batch = resolve_batch(top.batch, layout.dp)
    return layout, batch, execution_plan(layout, batch, top.trainer, top.parallel, run.datamodule.spec,
                                         top.fault_tolerance.engine)


def _node_of(group: Any) -> Any:
    """A typed group as the config node it is read back from."""
    if isinstance(group, TargetModelConfig):
        return {"_target_": group.target, **group.kwargs}
    if isinstance(group, UserDataConfig):
        return dict(group.node)
    return OmegaConf.to_container(OmegaConf.structured(group))
