"""Measure this machine for the planner: FLOP/s of a model-shaped workload per core and dtype, and the
bandwidth and latency of gloo collectives between two local processes.

    python -m disttrain.plan --calibrate
"""

from __future__ import annotations

import os
import platform
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from disttrain.plan.hardware import HardwareProfile, Link

DEFAULT_LOOPBACK = Link(bandwidth=1e9, latency=100e-6)
"""gloo over loopback when not calibrated: a cautious 1 GB/s and 100 us per message."""


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where it exists)."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def total_memory_bytes() -> float:
    """Physical memory of this machine."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _workload(width: int = 256) -> nn.Module:
    # a transformer block's MLP and a projection: the matmul shapes a small GPT spends its time in
    return nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.LayerNorm(width))


def measure_compute(seconds: float = 1.0, threads: int = 1) -> dict[str, float]:
    """FLOP/s of forward plus backward of a block-shaped workload on ``threads`` threads, per dtype
    (``bf16`` under CPU autocast, only where the CPU has native bf16)."""
    from disttrain.config.precision import native_bf16

    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model, x = _workload(), torch.randn(16 * 64, 256)
        rates = {"fp32": _rate(model, x, seconds, None)}
        if native_bf16(uses_gpu=False)[0]:
            rates["bf16"] = _rate(model, x, seconds, torch.bfloat16)
        else:
            rates["bf16"] = rates["fp32"] / 3  # emulated bf16 on CPUs without it measured ~0.3x fp32
        return rates
    finally:
        torch.set_num_threads(saved_threads)


def _rate(model: nn.Module, x: torch.Tensor, seconds: float, dtype: torch.dtype | None) -> float:
    def step() -> None:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = F.mse_loss(model(x).float(), x)
        loss.backward()

    with FlopCounterMode(display=False) as counter:
        step()
    flops, runs = counter.get_total_flops(), 0
    step()  # warm-up
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        step()
        runs += 1
    return flops * runs / (time.perf_counter() - start)


def _link_rank(rank: int, init_file: str, sizes: list[int], out: dict) -> None:
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        for size in sizes:
            buf = torch.zeros(size // 4)
            for _ in range(3):
                dist.all_reduce(buf)
            runs, start = 0, time.perf_counter()
            while runs < 5 or time.perf_counter() - start < 0.3:
                dist.all_reduce(buf)
                runs += 1
            if rank == 0:
                out[size] = (time.perf_counter() - start) / runs
    finally:
        dist.destroy_process_group()


def measure_link() -> Link:
    """alpha-beta fit of gloo all-reduces between two local processes: latency from a 4-byte all-reduce,
    bandwidth from a 16 MiB one (a 2-rank ring all-reduce sends the buffer once each way: 2(N-1)/N = 1)."""
    import torch.multiprocessing as mp

    sizes = [4, 16 * 2**20]
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp, ctx.Manager() as manager:
        out = manager.dict()
        init_file = os.path.join(tmp, "init")
        procs = [ctx.Process(target=_link_rank, args=(r, init_file, sizes, out)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError("the link measurement's ranks failed")
        small, large = out[sizes[0]], out[sizes[1]]
    latency = small / 2  # a 2-rank ring all-reduce is two steps
    return Link(bandwidth=sizes[1] / max(large - small, 1e-9), latency=latency)


def this_machine(flops_per_core: dict[str, float], links: Link | None, source: str) -> HardwareProfile:
    """This machine as a profile whose device is one core (CPU ranks share the cores; see ``estimate``)."""
    cores = os.cpu_count() or 1
    link = links or DEFAULT_LOOPBACK
    return HardwareProfile(f"machine ({cpu_model()}, {cores} cores)", flops_per_core, total_memory_bytes() / cores,
                           link, link, cores, None, source, cpu=True)


def calibrate(seconds: float = 1.0) -> HardwareProfile:
    """Measure compute per core and the loopback link; the profile of this machine."""
    compute = measure_compute(seconds)
    link = measure_link()
    return this_machine(compute, link, f"calibrated {time.strftime('%Y-%m-%d %H:%M')}")
