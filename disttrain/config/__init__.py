"""A run's configuration: the typed schema (``schema``) and the one validation pass (``validation``)."""

from disttrain.config.schema import (
    PRECISIONS,
    BatchConfig,
    CheckpointConfig,
    ExpectConfig,
    TrainConfig,
    TrainerConfig,
    register,
)
from disttrain.config.validation import (
    ExecutionPlan,
    ResolvedBatch,
    RunConfig,
    checkpoint_folder,
    parallel_options,
    resolve_batch,
    validate,
)

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
