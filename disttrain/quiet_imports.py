"""Optional libraries imported without the warnings they log on import that are not the user's to act on."""

from __future__ import annotations

import logging
from collections.abc import Generator
from contextlib import contextmanager
from types import ModuleType

NOISY_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes.backends.cpu.ops")
"""torchao warns for each of its CUDA kernel libraries a CPU-only torch cannot load (also when peft imports it),
torch for an enum torchao registers, and bitsandbytes' CPU backend that an optional package of faster kernels is
absent (its fallback computes the same)."""


@contextmanager
def quiet_imports() -> Generator[None, None, None]:
    """Hold ``NOISY_LOGGERS`` to errors while the block runs (an import of torchao, peft or bitsandbytes)."""
    loggers = [logging.getLogger(name) for name in NOISY_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def transformers_with_models() -> ModuleType:
    """``transformers``, its model classes' common code imported under ``quiet_imports``: that code imports torchao
    wherever it is installed (transformers' own quantisers), and the first such import in a process logs torchao's
    warnings; the job's validation and each rank reach it first through here."""
    with quiet_imports():
        import transformers
        import transformers.modeling_utils  # noqa: F401
    return transformers
