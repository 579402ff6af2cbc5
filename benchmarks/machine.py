"""What every benchmark table names: the machine it was measured on."""

from __future__ import annotations

import platform
from pathlib import Path


def cpu_model() -> str:
    """The CPU's model name (benchmark tables name the machine they were measured on)."""
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def cpu_features() -> str:
    """The instruction sets that decide the fast precision here: native bf16 (AVX512-BF16, AMX) or not."""
    import torch

    found = [name for name, probe in (("AMX", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported"),
                                      ("AVX512", "_is_avx512_supported"), ("AVX2", "_is_avx2_supported"))
             if getattr(torch.cpu, probe, lambda: False)()]
    return ", ".join(found) if found else "no AVX2"
