"""Which lines of Python made the host wait for the GPU: every synchronising CUDA call in a window, by source.

A host read (``.item()``, ``float(tensor)``, a device-to-host copy) stops the host until the GPU has run
everything queued before it; the GPU then idles while the host prepares the next work. torch reports each such
call as a warning under ``torch.cuda.set_sync_debug_mode("warn")``; this catches those warnings and keeps the
Python stack of each, so that a profile can name the lines (the profiler's timeline shows that the GPU idled,
not which line asked).
"""

from __future__ import annotations

import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

SYNC_WARNING = "called a synchronizing CUDA operation"
"""The text of torch's warning for a synchronising call under its sync debug mode."""

SKIPPED_FRAMES = (f"{Path(torch.__file__).parent}/", f"{Path(warnings.__file__)}", f"{Path(__file__)}")
"""Frames that say nothing of who asked: torch's own, the warnings module's and this module's."""


class HostReads:
    """Records the synchronising CUDA calls made between ``start()`` and ``stop()``, grouped by the Python stack
    that made them (``frames`` innermost frames outside torch)."""

    def __init__(self, frames: int = 6) -> None:
        self.frames = frames
        """Frames of each stack kept, innermost first."""
        self.counts: Counter[tuple[str, ...]] = Counter()
        """How often each stack (frames as ``file:line in function``) synchronised."""
        self._catcher: warnings.catch_warnings | None = None
        self._previous_mode: int | None = None
        self._show_other: Any = warnings.showwarning

    def start(self, cuda: bool) -> None:
        """Record from here on; ``cuda``: also switch torch's sync debug mode on (a CPU run makes no such call)."""
        self._catcher = warnings.catch_warnings()
        self._catcher.__enter__()
        warnings.filterwarnings("always", message=f".*{SYNC_WARNING}")
        self._show_other = warnings.showwarning
        warnings.showwarning = self._show
        if cuda:
            self._previous_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")

    def stop(self) -> None:
        """Stop recording; the warning filters and torch's mode are as before ``start()``."""
        if self._previous_mode is not None:
            torch.cuda.set_sync_debug_mode(self._previous_mode)
            self._previous_mode = None
        if self._catcher is not None:
            self._catcher.__exit__(None, None, None)
            self._catcher = None

    @property
    def total(self) -> int:
        """Synchronising calls recorded."""
        return sum(self.counts.values())

    def _show(self, message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
              line: str | None = None) -> None:
        if SYNC_WARNING not in str(message):
            return self._show_other(message, category, filename, lineno, file, line)
        frames = [f"{frame.filename}:{frame.lineno} in {frame.name}" for frame in reversed(traceback.extract_stack())
                  if not frame.filename.startswith(SKIPPED_FRAMES)]
        self.counts[tuple(frames[:self.frames])] += 1
        return None

    def table(self, steps: int) -> str:
        """The stacks that synchronised, most frequent first, with how often per step."""
        lines = [f"{self.total} synchronising CUDA calls in {steps} steps ({self.total / max(steps, 1):.1f} a step)"]
        for stack, count in self.counts.most_common():
            lines.append(f"\n{count / max(steps, 1):.1f} a step ({count} in all):")
            lines.extend(f"    {frame}" for frame in stack)
        return "\n".join(lines) + "\n"

