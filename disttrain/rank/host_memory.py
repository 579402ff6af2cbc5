"""Host memory that freed tensors leave behind stays mapped for the next step.

glibc's malloc serves large allocations by mapping fresh pages and returns the free top of its heap to the OS;
a training step frees and allocates the same activation sizes every step, so each step faulted the same memory
in again (on a CPU, hundreds of page faults in each step of GPT micro, which a short step feels;
benchmarks/README.md, Figures cited elsewhere).
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""glibc's ``mallopt`` parameters (malloc.h)."""

HEAP_UP_TO = 32 << 20
"""Allocations up to this size come from the heap: glibc's largest mmap threshold on 64-bit systems."""

TRIM_PAST = 1 << 30
"""The heap's free top goes back to the OS only past this size."""

USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")
"""glibc's own environment settings: a user who set one chose the allocator's behaviour already."""


def keep_freed_host_memory() -> bool:
    """Set glibc's thresholds so that freed memory is reused rather than unmapped and faulted in again: the
    process's resident memory then stays near its peak. True where set; False where the C library is not glibc,
    another allocator is preloaded, or the user set glibc's own variables."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    if any(name in os.environ for name in USER_SETTINGS) or "malloc" in os.environ.get("LD_PRELOAD", ""):
        return False
    libc = ctypes.CDLL("libc.so.6")
    # setting either threshold also stops glibc from raising them on its own as large blocks are freed
    return bool(libc.mallopt(M_MMAP_THRESHOLD, HEAP_UP_TO)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_PAST))
