"""Optimiser registry: configs name an optimiser (``optim.name``) and ``build_optimizer`` builds it.

Each optimiser module registers a builder ``(cfg, model) -> Optimizer`` together with its config schema,
a dataclass whose ``validate()`` rejects impossible values before any rank starts. The optimiser is built
after the model is wrapped (DDP, FSDP2), so it sees the parameters that are actually trained.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from disttrain.registry import Registry

OPTIMIZERS: Registry[torch.optim.Optimizer] = Registry("optim")

# The optimiser modules register themselves in OPTIMIZERS, so they are imported after it exists.
from disttrain.optim.groups import param_groups  # noqa: E402
from disttrain.optim.lamb import Lamb, LambConfig  # noqa: E402
from disttrain.optim.lars import Lars, LarsConfig  # noqa: E402
from disttrain.optim.scheduler import SchedulerConfig, build_scheduler  # noqa: E402
from disttrain.optim.torch_optims import AdamWConfig, SGDConfig  # noqa: E402


def build_optimizer(cfg: Any, model: nn.Module) -> torch.optim.Optimizer:
    """Validate ``cfg`` and build the optimiser it names over ``model``'s trainable parameters."""
    cfg.validate()
    return OPTIMIZERS.build(cfg, model)


__all__ = [
    "OPTIMIZERS",
    "AdamWConfig",
    "Lamb",
    "LambConfig",
    "Lars",
    "LarsConfig",
    "SGDConfig",
    "SchedulerConfig",
    "build_optimizer",
    "build_scheduler",
    "param_groups",
]
