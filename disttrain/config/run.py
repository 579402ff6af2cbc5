"""The validated run: what the job's one validation returns and what every rank reads back (``resolved``)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from disttrain.checkpoint.init_weights import InitWeightsFile
from disttrain.config.batch import ResolvedBatch
from disttrain.config.execution import ExecutionPlan
from disttrain.config.schema import TrainConfig
from disttrain.parallel.layout import Layout


@dataclass(frozen=True)
class RunConfig:
    """A validated run: typed objects for every group plus the resolved numbers derived from them."""

    train: TrainConfig
    """The top-level groups (trainer, parallel, comm, checkpoint, fault tolerance, federated, ...)."""
    model: Any
    """The typed model config (a registered model's schema, or a user model by ``_target_``)."""
    data: Any
    """The typed data config."""
    optim: Any
    """The typed optimiser config."""
    scheduler: Any
    """The learning-rate schedule."""
    layout: Layout
    """The resolved degrees and where model state lives (what the strategy, the kinds and the planner read)."""
    batch: ResolvedBatch
    """The resolved batch numbers."""
    yaml: str
    """The resolved config as YAML (what workers receive and what is written to the run directory)."""
    notices: tuple[str, ...] = ()
    """Lines to show the user before ranks start (e.g. how many ranks ``trainer.devices=auto`` chose)."""
    plan: ExecutionPlan | None = None
    """How the run executes."""
    datamodule: Any = field(default=None, compare=False, repr=False)
    """The data module validation built (its datasets load on first use): a rank builds no other."""
    world_sizes: tuple[int, ...] = ()
    """With ``trainer.devices=MIN:MAX`` under disttrain's supervisor: the world sizes, largest first, that the
    run may restart on after losing ranks (empty: only its own)."""
    choice: Any = field(default=None, compare=False, repr=False)
    """With ``parallel=auto``: the layouts the planner weighed, predicted, and the one it chose
    (``disttrain.plan.auto.Choice``, which the plan's pictures draw); None otherwise."""
    init_weights: InitWeightsFile | None = None
    """The ``model.init_weights`` file as the job checked it (path, tensors, size), which the start-up line and
    ``results.json`` name; None for a run without one."""

    @property
    def dims(self) -> Layout:
        """The resolved parallel degrees: the layout itself (a ``Layout`` is a ``ParallelDims``)."""
        return self.layout

    @property
    def config_hash(self) -> str:
        """Short hash of the resolved config, excluding where it runs (run_dir, resume)."""
        text = self.yaml.replace(self.train.run_dir, "<run_dir>")
        text = "\n".join(line for line in text.splitlines() if not line.startswith(("run_dir:", "resume:")))
        return hashlib.sha256(text.encode()).hexdigest()[:12]
