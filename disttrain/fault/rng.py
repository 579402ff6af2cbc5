"""Every rank's random-number state in the checkpoint, so a resumed run draws what the uninterrupted one drew."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from disttrain.fault.per_rank import PerRankState


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


class RandomStates(PerRankState):
    """Saves all ranks' generator states with each checkpoint and restores each rank's own on resume
    (Lightning saves none). On another world size, rank r takes the state of rank r modulo the saved world
    size: the run continues, no longer bitwise."""

    def own_state(self) -> dict[str, Any]:
        """This rank's generator states."""
        return rng_state()

    def restore(self, state: dict[str, Any], same_world: bool) -> None:
        """Set this process's generators."""
        set_rng_state(state)
