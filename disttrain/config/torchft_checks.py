"""What ``fault_tolerance.engine=torchft`` accepts, checked before any rank starts.

Replica groups are the ``dp_replicate`` replicas of DDP or HSDP; everything that keeps state per rank across
steps or decides membership itself is refused here, each with the reason (a restarted group copies a live
group's state, which must then be all a rank needs).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from disttrain.errors import ConfigError, Refusal
from disttrain.parallel.layout import Layout

KEY = "fault_tolerance.engine"


def torchft_installed() -> bool:
    """Whether the optional ``torchft`` package can be imported (it is only imported under engine=torchft)."""
    from importlib.util import find_spec

    return find_spec("torchft") is not None


def torchft_layout_refusal(engine: str, layout: Layout) -> Refusal | None:
    """How ``fault_tolerance.engine`` (``engine``) refuses ``layout``, or None where it runs there: torchft's
    replica groups are the replicas of ``dp_replicate`` (at least 2) under DDP or HSDP, never pipeline stages nor
    ZeRO-1's optimiser state sharded over replicas that fail independently. The one rule of the engine against a
    layout: validation raises its error for the run's layout, and ``parallel=auto`` weighs only the candidates it
    leaves."""
    if engine != "torchft":
        return None
    if layout.pp_enabled:
        return Refusal(KEY, "torchft", "restart", f"with parallel.pp={layout.pp} (pipeline stages step by hand; "
                       "replica groups run DDP or HSDP layouts)", "pipelines (pipeline stages step by hand)")
    if layout.dp_replicate < 2:
        return Refusal(KEY, "torchft", "restart", f"with parallel.dp_replicate={layout.dp_replicate} (replica "
                       "groups are the replicas of parallel.dp_replicate: at least 2, e.g. parallel=ddp or "
                       "parallel=hsdp parallel.dp_replicate=3)", "layouts of fewer than 2 replicas (replica groups "
                       "are the replicas of parallel.dp_replicate)")
    if layout.shards_only_optimizer_state:
        return Refusal(KEY, "torchft", "restart", f"with parallel.{layout.zero_setting} (ZeRO-1 shards optimiser "
                       "state over the replicas that fail independently; use parallel=ddp or parallel=hsdp)",
                       "ZeRO-1 (it shards optimiser state over replicas that fail independently)")
    return None


def check_torchft(top: Any, layout: Layout, net: nn.Module) -> None:
    """Raise ConfigError where ``engine=torchft`` cannot run this config: the package missing, no replicas to
    survive, a kind of run with its own membership or per-rank state, BatchNorm, or ``min_groups`` out of range."""
    ft, p = top.fault_tolerance, top.parallel
    if ft.engine != "torchft":
        return
    if not torchft_installed():
        raise ConfigError(KEY, "torchft", "restart, or install the torchft extra (pip install 'disttrain[torchft]'): "
                          "the torchft package is not installed")
    if p.federated or p.servers or p.sync_every:
        what = "parallel=federated" if p.federated else (f"parallel.servers={p.servers}" if p.servers
                                                         else f"parallel.sync_every={p.sync_every}")
        raise ConfigError(KEY, "torchft", f"restart with {what} (federated rounds, parameter servers and Local SGD "
                          "keep their own membership or replicas apart; torchft replica groups average every step)")
    refusal = torchft_layout_refusal(ft.engine, layout)
    if refusal is not None:
        raise refusal.error()
    if top.comm.name != "none":
        raise ConfigError(KEY, "torchft", f"restart with comm={top.comm.name}, or comm=none (replica groups "
                          "exchange fp32 gradients through torchft; a codec's residuals and factors are per rank "
                          "and would not match in a group that copied a peer's state)")
    if any(isinstance(m, _BatchNorm) for m in net.modules()):
        raise ConfigError(KEY, "torchft", "restart for a model with BatchNorm layers (their running statistics "
                          "are buffers that no replica-group exchange averages, so groups would drift apart)")
    if ft.min_groups > layout.dp_replicate:
        raise ConfigError("fault_tolerance.min_groups", ft.min_groups,
                          f"1 to parallel.dp_replicate={layout.dp_replicate} replica groups")
