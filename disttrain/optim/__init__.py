"""Optimisers: configs name an optimiser (``optim.name``) and ``build_optimizer`` builds it.

Each optimiser module registers a builder ``(cfg, model) -> Optimizer`` together with its config schema
(see ``registry``), a dataclass whose ``validate()`` rejects impossible values before any rank starts;
importing this package imports every built-in optimiser module and so registers it. The optimiser is
built after the model is wrapped (DDP, FSDP2), so it sees the parameters that are actually trained.
"""

from __future__ import annotations

from disttrain.optim.groups import param_groups
from disttrain.optim.lamb import Lamb, LambConfig
from disttrain.optim.lars import Lars, LarsConfig
from disttrain.optim.muon import Muon, MuonConfig
from disttrain.optim.onebit_adam import OneBitAdam, OneBitAdamConfig
from disttrain.optim.registry import OPTIMIZERS, build_optimizer
from disttrain.optim.scheduler import SchedulerConfig, build_scheduler
from disttrain.optim.soap import Soap, SoapConfig
from disttrain.optim.torch_optims import AdamWConfig, SGDConfig

__all__ = [
    "OPTIMIZERS",
    "AdamWConfig",
    "Lamb",
    "LambConfig",
    "Lars",
    "LarsConfig",
    "Muon",
    "MuonConfig",
    "OneBitAdam",
    "OneBitAdamConfig",
    "SGDConfig",
    "SchedulerConfig",
    "Soap",
    "SoapConfig",
    "build_optimizer",
    "build_scheduler",
    "param_groups",
]
