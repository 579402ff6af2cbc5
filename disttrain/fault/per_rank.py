"""Checkpoint state that differs per rank (generator states, compression residuals).

A checkpoint's callback states come from rank 0 alone (``meta.pt``), so each rank's state is gathered into
rank 0's as the checkpoint is written, and each rank takes its own back on load.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist


class PerRankState(pl.Callback, ABC):
    """Base of callbacks whose checkpoint state is one entry per rank; subclasses say what the entry is."""

    @abstractmethod
    def own_state(self) -> Any:
        """This rank's entry (plain data and CPU tensors)."""

    @abstractmethod
    def restore(self, state: Any, same_world: bool) -> None:
        """Take back this rank's entry (``same_world``: the checkpoint was written on as many ranks)."""

    def state_dict(self) -> dict[str, Any]:
        """Every rank's entry, gathered (called on all ranks as a checkpoint is written)."""
        own = self.own_state()
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return {"ranks": [own]}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, own)
        return {"ranks": gathered}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """This rank's entry (rank r takes entry r modulo the saved world size)."""
        ranks = state_dict.get("ranks") or []
        if ranks:
            rank = dist.get_rank() if dist.is_initialized() else 0
            world = dist.get_world_size() if dist.is_initialized() else 1
            self.restore(ranks[rank % len(ranks)], same_world=len(ranks) == world)
