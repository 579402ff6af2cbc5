"""The profiler a run's Trainer gets when none is asked for."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from lightning.pytorch.profilers import PassThroughProfiler

_NO_PROFILING = nullcontext()


class NoProfiler(PassThroughProfiler):
    """Lightning's default profiler (records nothing), without building a generator context per hook call: Lightning
    wraps every hook call of the module, the strategy and each callback in ``profile`` (its public Profiler API)."""

    def profile(self, action_name: str) -> Any:  # noqa: ARG002 - Lightning's signature
        """One shared null context: nothing to start or stop."""
        return _NO_PROFILING
