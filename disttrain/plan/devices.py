"""What a device computes, holds and sends, and the links between devices: the terms every prediction of
the planner is made in, whether the numbers are stated by a vendor or measured on this machine."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Link:
    """A link between the devices of a collective."""

    bandwidth: float
    """Bytes per second each device can send (one direction)."""
    latency: float
    """Seconds per message (the alpha of the alpha-beta model)."""


@dataclass(frozen=True)
class HardwareProfile:
    """One kind of device and the links between devices of a node and across nodes."""

    name: str
    """Profile name (``plan.profile``)."""
    flops: dict[str, float]
    """Achievable matrix-multiply FLOP/s per device by compute dtype (``fp32``, ``bf16``): peak x
    ``EFFICIENCY`` for stated specs, measured on large matrix products for a calibrated machine."""
    memory_bandwidth: float
    """Achievable memory bytes per second per device (shared by the ranks of a CPU)."""
    op_overhead: float
    """Seconds each operator costs beyond its work (dispatch, autograd; a kernel launch on a GPU)."""
    memory_bytes: float
    """Memory per device a run may fill (bytes)."""
    intra_node: Link
    """Link between devices of one node (NVLink; loopback for CPU ranks)."""
    inter_node: Link
    """Link between nodes (InfiniBand / Ethernet), per device."""
    devices_per_node: int
    """Devices (ranks) per node; groups within one node use ``intra_node``."""
    watts: float | None = None
    """Power per device under load (TDP for stated specs), for predicted energy; None when unknown."""
    source: str = ""
    """Where the numbers come from (datasheet, calibration and when)."""
    cpu: bool = False
    """A CPU whose device is one core: ranks on a node share its cores (threads per rank = cores / ranks), and
    its memory (``memory_bytes`` is per core)."""
    memory_per_rank: bool = False
    """``memory_bytes`` is what each rank may use (a stated budget, ``plan.memory_gb``), also on a CPU."""
    idle_watts: float | None = None
    """Power per device while it waits (communication that compute does not hide, a pipeline's bubble), for
    predicted energy; None: ``watts`` for the whole step (no stated profile publishes an idle figure)."""


def native_bf16(uses_gpu: bool) -> tuple[bool, str]:
    """Whether the device computes bf16 natively (a GPU that supports it; a CPU with AMX or AVX512-BF16),
    and what was found."""
    if uses_gpu:
        supported = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return supported, "the GPU supports bf16" if supported else "the GPU has no bf16"
    found = [name for name, probe in (("AMX", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported"))
             if getattr(torch.cpu, probe, lambda: False)()]
    return bool(found), f"this CPU has {' and '.join(found)}" if found else "this CPU has no bf16 instructions"
