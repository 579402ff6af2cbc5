"""The device a ``mode=dryrun`` rank runs on, the memory available there, and its allocator's peaks.

A dry run builds ONE rank of a layout in this process, whatever the layout's world size: on a GPU machine that rank
runs on the first GPU (``cuda:0``, one GPU is all it needs), so the memory it is held against is that GPU's free
memory, not the host's.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

GIB = 2**30
"""Bytes in a GiB: the CUDA allocator's peaks are printed in GiB, as torchtitan's memory monitor logs them."""


def rank_device(accelerator: str) -> torch.device:
    """Where a dry run's rank runs: ``cuda:0`` where ``trainer.accelerator`` asks for a GPU (gpu, cuda, or auto)
    and torch sees one, else the CPU."""
    if accelerator != "cpu" and torch.cuda.is_available():
        return torch.device("cuda", 0)
    return torch.device("cpu")


def machine_memory_bytes() -> int:
    """Memory this machine has available now (``MemAvailable``; all of it where the kernel does not say)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_available(device: torch.device) -> tuple[int, str]:
    """Bytes a rank on ``device`` may fill now, and where they were read: a GPU's free memory
    (``torch.cuda.mem_get_info``), the host's available memory for the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free, f"free on {device} ({torch.cuda.get_device_name(device)})"
    return machine_memory_bytes(), "available on this machine"


def start_peaks(device: torch.device) -> None:
    """Make ``device`` current (a GPU) and start its allocator's peaks from now; nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)


def allocator_peaks(device: torch.device) -> dict[str, int]:
    """The CUDA allocator's peaks on ``device`` since ``start_peaks``: ``max_memory_allocated`` (bytes tensors
    held) and ``max_memory_reserved`` (bytes the allocator took from the GPU, its cached and fragmented blocks too:
    torchtitan's logged "memory" is this one, ``memory_stats()["reserved_bytes.all.peak"]``); empty on the CPU."""
    if device.type != "cuda":
        return {}
    return {"max_memory_allocated": torch.cuda.max_memory_allocated(device),
            "max_memory_reserved": torch.cuda.max_memory_reserved(device)}


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (a GPU's kernels run after the Python that launched them returns): a step
    is timed to its end."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
