"""Hardware profiles: what a device computes, holds and sends, for predicted step times.

Built-in profiles state vendors' published peaks (dense, no sparsity) times an achievable fraction; this
machine's profile is measured by ``python -m disttrain.plan --calibrate`` and stored as JSON (see
``profile_path``), so a plan on the CPU predicts with what the CPU really did.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from disttrain.errors import ConfigError


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


GB = 1e9
# Stated specs: NVIDIA H100 SXM5 and A100 SXM4 80GB datasheets (dense bf16 989 / 312 TFLOP/s, fp32 67 / 19.5,
# TF32 on tensor cores 495 / 156), NVLink 4 / 3 (900 / 600 GB/s both directions), 8 GPUs per HGX node, one
# 400 / 200 Gb/s InfiniBand NIC per GPU, HBM3 3.35 TB/s and HBM2e 2.04 TB/s (0.8 of it achievable). Achievable
# fraction 0.5 of peak FLOP/s: what torchtitan and Megatron report as MFU for well-tuned dense LLM training on
# these parts (40-55%); 5 us per kernel launch.
EFFICIENCY = 0.5
PROFILES: dict[str, HardwareProfile] = {
    "h100_sxm": HardwareProfile(
        "h100_sxm", {"bf16": 989e12 * EFFICIENCY, "fp32": 495e12 * EFFICIENCY}, 3.35e12 * 0.8, 5e-6, 80 * GB,
        Link(450 * GB, 3e-6), Link(50 * GB, 10e-6), 8, 700.0, "NVIDIA H100 SXM5 datasheet x 0.5, NDR 400 Gb/s"),
    "a100_80gb": HardwareProfile(
        "a100_80gb", {"bf16": 312e12 * EFFICIENCY, "fp32": 156e12 * EFFICIENCY}, 2.04e12 * 0.8, 5e-6, 80 * GB,
        Link(300 * GB, 3e-6), Link(25 * GB, 10e-6), 8, 400.0, "NVIDIA A100 SXM4 80GB datasheet x 0.5, HDR 200 Gb/s"),
}
"""Stated profiles by name."""


def profile_path() -> Path:
    """Where ``--calibrate`` stores this machine's profile: ``$DISTTRAIN_PROFILE``, else
    ``~/.cache/disttrain/machine_profile.json``."""
    configured = os.environ.get("DISTTRAIN_PROFILE")
    return Path(configured) if configured else Path.home() / ".cache" / "disttrain" / "machine_profile.json"


def save_profile(profile: HardwareProfile, path: Path | None = None) -> Path:
    """Write ``profile`` as JSON (atomically) and return the path."""
    path = path or profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(profile), indent=2))
    tmp.replace(path)
    return path


def load_profile(path: Path) -> HardwareProfile:
    """A profile written by ``save_profile`` (plain JSON; nothing in it is executed)."""
    raw = json.loads(path.read_text())
    raw["intra_node"], raw["inter_node"] = Link(**raw["intra_node"]), Link(**raw["inter_node"])
    return HardwareProfile(**raw)


def resolve_profile(name: str, memory_gb: float | None = None) -> HardwareProfile:
    """The profile ``plan.profile`` names: ``machine`` (this machine: its calibration if stored, else a quick
    measurement of compute and memory with default loopback links) or a stated one; ``memory_gb`` overrides
    the memory per device."""
    from dataclasses import replace

    if name == "machine":
        path = profile_path()
        profile = load_profile(path) if path.exists() else _quick_machine_profile()
    elif name in PROFILES:
        profile = PROFILES[name]
    else:
        raise ConfigError("plan.profile", name, f"one of {['machine', *PROFILES]}")
    if memory_gb is not None:
        if memory_gb <= 0:
            raise ConfigError("plan.memory_gb", memory_gb, "a positive number of GB per device, or null")
        profile = replace(profile, memory_bytes=memory_gb * GB)
    return profile


@functools.cache
def _quick_machine_profile() -> HardwareProfile:
    """This machine measured briefly, once per process: every plan of a process (``parallel=auto``'s choice
    and ``mode=plan``'s table of it) predicts with the same rates."""
    from disttrain.plan.calibrate import measure_compute, measure_memory_bandwidth, measure_op_overhead, this_machine

    compute, bandwidth = measure_compute(0.2), measure_memory_bandwidth(0.1)
    return this_machine(compute, bandwidth, measure_op_overhead(0.1, compute["fp32"], bandwidth), links=None,
                        source="quick measurement; python -m disttrain.plan --calibrate also measures the links")
