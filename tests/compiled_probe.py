"""A callback that records which modules of a run's model torch.compile wraps, for tests that check what
``trainer.compile_scope`` reached on the ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

RECORD = "compiled-modules.json"
"""The file in the run directory that ``CompiledModules`` writes."""


class CompiledModules(pl.Callback):
    """As training starts, rank 0 writes to ``RECORD`` the names of the modules of the task's model that
    ``nn.Module.compile`` wrapped, as a JSON list ("" is the model itself)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
        if trainer.is_global_zero:
            names = [name for name, module in pl_module.net.named_modules()
                     if getattr(module, "_compiled_call_impl", None) is not None]
            (Path(trainer.default_root_dir) / RECORD).write_text(json.dumps(names))


def compiled_modules(run_dir: Path) -> list[str]:
    """The names ``CompiledModules`` recorded in ``run_dir``."""
    return json.loads((Path(run_dir) / RECORD).read_text())
