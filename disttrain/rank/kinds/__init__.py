"""The kinds of run, one module each, by the name validation gives them (``ExecutionPlan.kind``)."""

from __future__ import annotations

from disttrain.rank.kinds.base import RunKind
from disttrain.rank.kinds.federated import Federated
from disttrain.rank.kinds.local_sgd import LocalSGD
from disttrain.rank.kinds.param_server import ParameterServer
from disttrain.rank.kinds.pipelined import Pipelined
from disttrain.rank.kinds.synchronous import Synchronous
from disttrain.rank.kinds.torchft import TorchFT

KINDS: dict[str, type[RunKind]] = {kind.name: kind for kind in (Synchronous, Pipelined, LocalSGD, ParameterServer,
                                                                  Federated, TorchFT)}
"""Every kind of run by name."""

__all__ = ["KINDS", "RunKind"]
