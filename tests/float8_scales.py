"""A callback that records, after every optimiser step, the scale each float8-gathered weight keeps for FSDP2's
gathers beside the scale its whole weight asks for."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor

SCALES_FILE = "gather_scales.json"
"""Where rank 0 writes them, in the run directory: per step, per float8 layer, ``[kept, expected]``."""


class RecordGatherScales(pl.Callback):
    """Per optimiser step, for every float8 layer with a sharded weight: the scale kept on its local shard for the
    next gathers (None: none kept, each gather takes its own) and float8's largest value over the amax of the
    whole weight, gathered here from every shard."""

    def __init__(self) -> None:
        self.steps: list[list[list[float | None]]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        from torchao.float8.float8_linear import Float8Linear

        rows = []
        with torch.no_grad():
            for module in pl_module.net.modules():
                if not (isinstance(module, Float8Linear) and isinstance(module.weight, DTensor)):
                    continue
                kept = getattr(module.weight._local_tensor, "_precomputed_scale", None)
                amax = module.weight.full_tensor().abs().max().double()
                expected = (torch.finfo(torch.float8_e4m3fn).max / amax).float()
                rows.append([None if kept is None else float(kept), float(expected)])
        self.steps.append(rows)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            (Path(trainer.default_root_dir) / SCALES_FILE).write_text(json.dumps(self.steps))
