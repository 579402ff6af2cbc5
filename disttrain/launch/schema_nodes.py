"""Imported by the fork server before it forks a rank: builds the structured config node of every schema a run's
config can name (the top level, the schedule, each registered model, data set and optimiser) and of the decisions a
rank reads beside them (layout, batch, execution plan), which
``disttrain.config.typed.schema_node`` keeps. A forked rank reading its run then finds the nodes it merges
into already built, where each rank built its own, which saves a short DDP run of GPT micro CPU time
(benchmarks/README.md, Figures cited elsewhere)."""

from disttrain.config.batch import ResolvedBatch
from disttrain.config.execution import ExecutionPlan
from disttrain.config.schema import TrainConfig
from disttrain.config.typed import schema_node
from disttrain.data import DATA
from disttrain.models import MODELS
from disttrain.optim import OPTIMIZERS, SchedulerConfig
from disttrain.parallel.layout import Layout

SCHEMAS = (TrainConfig, SchedulerConfig, Layout, ResolvedBatch, ExecutionPlan,
           *(registry.get(name).schema for registry in (MODELS, DATA, OPTIMIZERS) for name in registry.names()))
"""Every schema a rank's run is merged into."""

for schema in SCHEMAS:
    schema_node(schema)
