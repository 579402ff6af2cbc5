"""glibc's thresholds as ``keep_freed_host_memory`` sets them, seen from a fresh process's own allocations."""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc"
    or not hasattr(ctypes.CDLL("libc.so.6", use_errno=True), "mallinfo2"), reason="needs glibc >= 2.33")

PROBE = """
import ctypes, sys
from disttrain.rank.host_memory import keep_freed_host_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
kept = keep_freed_host_memory() if sys.argv[1] == "keep" else None
before = libc.mallinfo2().hblks
block = libc.malloc(20 << 20)
print(kept, libc.mallinfo2().hblks - before)
libc.free(ctypes.c_void_p(block))
"""


def probe(mode: str, **env: str) -> tuple[str, int]:
    """In a fresh process: what ``keep_freed_host_memory`` answered, and how many mapped blocks a 20 MB
    allocation added (1: glibc mapped fresh pages for it; 0: it came from the heap)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, cwd=ROOT,
                          env={**clean, "PYTHONPATH": str(ROOT), **env}, check=True)
    kept, mapped = done.stdout.split()
    return kept, int(mapped)


def test_a_steps_large_blocks_come_from_the_heap_once_kept():
    assert probe("default") == ("None", 1)  # glibc's default: a fresh mapping, unmapped again when freed
    assert probe("keep") == ("True", 0)


def test_the_users_own_allocator_settings_are_left_alone():
    assert probe("keep", MALLOC_TRIM_THRESHOLD_="131072") == ("False", 1)
    assert probe("keep", LD_PRELOAD="") == ("True", 0)
