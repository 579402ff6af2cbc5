"""Every rank's random-number state in the checkpoint, so a resumed run draws what the uninterrupted one drew."""

from __future__ import annotations

import random
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist


def rng_state() -> dict[str, Any]:
    """This process's Python, NumPy, torch (and CUDA) generator states, as plain data and tensors only."""
    kind, keys, position, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, cached),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned."""
    random.setstate(state["python"])
    kind, keys, position, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class RandomStates(pl.Callback):
    """Saves all ranks' generator states with each checkpoint and restores each rank's own on resume.

    Lightning saves no generator state, and a checkpoint's callback states come from rank 0 alone, so
    every rank's state is gathered into rank 0's. On a different world size, rank r takes the state of
    rank r modulo the saved world size (the run continues, no longer bitwise).
    """

    def state_dict(self) -> dict[str, Any]:
        """Every rank's generator states, gathered (called on all ranks as a checkpoint is written)."""
        own = rng_state()
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return {"ranks": [own]}
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, own)
        return {"ranks": gathered}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take this rank's states from the checkpoint."""
        ranks = state_dict.get("ranks") or []
        if ranks:
            rank = dist.get_rank() if dist.is_initialized() else 0
            set_rng_state(ranks[rank % len(ranks)])
