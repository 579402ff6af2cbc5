"""A run's configuration: the typed schema (``schema``) and the one validation pass (``validation``)."""

from disttrain.config.batch import ResolvedBatch, resolve_batch
from disttrain.config.execution import ExecutionPlan
from disttrain.config.resume import checkpoint_folder
from disttrain.config.run import RunConfig
from disttrain.config.schema import (
    PRECISIONS,
    BatchConfig,
    CheckpointConfig,
    ExpectConfig,
    TrainConfig,
    TrainerConfig,
    register,
)
from disttrain.config.typed import parallel_options
from disttrain.config.validation import validate

__all__ = [
    "PRECISIONS",
    "BatchConfig",
    "CheckpointConfig",
    "ExecutionPlan",
    "ExpectConfig",
    "ResolvedBatch",
    "RunConfig",
    "TrainConfig",
    "TrainerConfig",
    "checkpoint_folder",
    "parallel_options",
    "register",
    "resolve_batch",
    "validate",
]
