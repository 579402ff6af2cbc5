"""Imported by the fork server before it forks a rank: builds the structured config node of every schema a run's
config can name (the top level, the schedule, each registered model, data set and optimiser), which
``disttrain.config.typed.schema_node`` keeps. A forked rank's validation then finds the nodes it merges into
already built, where each rank built its own, which saves a short DDP run of GPT micro CPU time
(benchmarks/README.md, Figures cited elsewhere)."""

from disttrain.config.schema import TrainConfig
from disttrain.config.typed import schema_node
from disttrain.data import DATA
from disttrain.models import MODELS
from disttrain.optim import OPTIMIZERS, SchedulerConfig

SCHEMAS = (TrainConfig, SchedulerConfig,
           *(registry.get(name).schema for registry in (MODELS, DATA, OPTIMIZERS) for name in registry.names()))
"""Every schema a composed config is merged into."""

for schema in SCHEMAS:
    schema_node(schema)
