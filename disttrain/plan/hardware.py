"""Hardware profiles by name, for predicted step times: the stated ones, and this machine's.

Built-in profiles state vendors' published peaks (dense, no sparsity) times an achievable fraction; this
machine's profile is measured by ``python -m disttrain.plan --calibrate`` and stored as JSON (see
``profile_path``), so a plan on the CPU predicts with what the CPU really did.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from disttrain.errors import ConfigError
from disttrain.plan.devices import HardwareProfile, Link

GB = 1e9
# Stated specs: NVIDIA H100 SXM5 and A100 SXM4 80GB datasheets (dense bf16 989 / 312 TFLOP/s, fp32 67 / 19.5,
# TF32 on tensor cores 495 / 156), NVLink 4 / 3 (900 / 600 GB/s both directions), 8 GPUs per HGX node, one
# 400 / 200 Gb/s InfiniBand NIC per GPU, HBM3 3.35 TB/s and HBM2e 2.04 TB/s (0.8 of it achievable). Achievable
# fraction of peak FLOP/s: that of the matrix products alone, since every other operator is timed apart at memory
# bandwidth and launch overhead (a whole step's MFU, lower, would charge those twice); 0.7 is the one value that
# puts the planner within 10% of each published run it models kernel for kernel (benchmarks/plan_at_scale.py);
# 5 us per kernel launch. Dense float8 (H100 SXM5: 1979 TFLOP/s, twice bf16; the H200's is the same) is the
# ``fp8`` rate, at the same fraction; the A100 has no float8 products (``trainer.fp8`` is refused there).
EFFICIENCY = 0.7
PROFILES: dict[str, HardwareProfile] = {
    "h100_sxm": HardwareProfile(
        "h100_sxm", {"bf16": 989e12 * EFFICIENCY, "fp32": 495e12 * EFFICIENCY, "fp8": 1979e12 * EFFICIENCY},
        3.35e12 * 0.8, 5e-6, 80 * GB,
        Link(450 * GB, 3e-6), Link(50 * GB, 10e-6), 8, 700.0, "NVIDIA H100 SXM5 datasheet x 0.7, NDR 400 Gb/s"),
    "a100_80gb": HardwareProfile(
        "a100_80gb", {"bf16": 312e12 * EFFICIENCY, "fp32": 156e12 * EFFICIENCY}, 2.04e12 * 0.8, 5e-6, 80 * GB,
        Link(300 * GB, 3e-6), Link(25 * GB, 10e-6), 8, 400.0, "NVIDIA A100 SXM4 80GB datasheet x 0.7, HDR 200 Gb/s"),
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
    the memory per device with a budget per rank (on a CPU too, whose ranks otherwise share its memory)."""
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
        profile = replace(profile, memory_bytes=memory_gb * GB, memory_per_rank=True)
    return profile


def profile_of_plan(plan: Any) -> HardwareProfile:
    """The profile a run's ``plan`` options name (``PlanConfig``): ``resolve_profile`` of ``plan.profile`` and
    ``plan.memory_gb``, with ``plan.watts`` and ``plan.idle_watts`` in place of its power where set."""
    from dataclasses import replace

    profile = resolve_profile(plan.profile, plan.memory_gb)
    if plan.watts is not None:
        profile = replace(profile, watts=plan.watts)
    if plan.idle_watts is not None:
        if profile.watts is None or plan.idle_watts > profile.watts:
            under_load = "none" if profile.watts is None else f"{profile.watts:g} W"
            raise ConfigError("plan.idle_watts", plan.idle_watts, f"at most the power under load ({under_load} per "
                              f"device on {profile.name}; plan.watts sets it)")
        profile = replace(profile, idle_watts=plan.idle_watts)
    return profile


@functools.cache
def _quick_machine_profile() -> HardwareProfile:
    """This machine measured briefly, once per process: every plan of a process (``parallel=auto``'s choice
    and ``mode=plan``'s table of it) predicts with the same rates."""
    from disttrain.plan.calibrate import measure_compute, measure_memory_bandwidth, measure_op_overhead, this_machine

    compute, bandwidth = measure_compute(0.2), measure_memory_bandwidth(0.1)
    return this_machine(compute, bandwidth, measure_op_overhead(0.1, compute["fp32"], bandwidth), links=None,
                        source="quick measurement; python -m disttrain.plan --calibrate also measures the links")
