"""What ``resume=`` names: a checkpoint folder or a run directory, and whether its checkpoint fits the model."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from disttrain.errors import ConfigError


def checkpoint_folder(resume: str) -> str:
    """``resume=PATH``: a checkpoint folder, or a run directory whose ``checkpoints/last.ckpt`` is taken."""
    path = os.path.expanduser(resume)
    allowed = "null, auto, a checkpoint folder (with meta.pt) or a run directory with checkpoints/last.ckpt"
    if not os.path.exists(path):
        raise ConfigError("resume", resume, f"{allowed}; there is no such path")
    last = os.path.join(path, "checkpoints", "last.ckpt")
    if os.path.isfile(os.path.join(path, "meta.pt")) and os.path.isfile(os.path.join(path, ".metadata")):
        return path
    if os.path.isdir(last):
        return last
    raise ConfigError("resume", resume, f"{allowed}; this is neither")


def check_resume_fits(checkpoint: str, net: Any) -> None:
    """``resume``'s checkpoint can be read (its ``meta.pt``, its index and every stored object are plain data, its
    shards as long as its index says) and holds this model's tensors at this model's shapes: a damaged or crafted
    checkpoint, or a run of another model size, is refused by name here, before any rank starts, rather than by
    the checkpoint reader in every rank."""
    from disttrain.checkpoint.io import CheckpointReadError, check_checkpoint, saved_shapes

    try:
        check_checkpoint(Path(checkpoint))
    except (OSError, CheckpointReadError) as err:
        cause = err.cause if isinstance(err, CheckpointReadError) else str(err)
        raise ConfigError("resume", checkpoint, f"a checkpoint folder that can be read; {cause}") from None
    saved = saved_shapes(Path(checkpoint))
    for name, tensor in net.state_dict().items():
        if name in saved and tuple(tensor.shape) != saved[name]:
            raise ConfigError("resume", checkpoint, f"a checkpoint of this model; its {name} is {list(saved[name])} "
                              f"where this model's is {list(tensor.shape)} (the model's settings differ from the "
                              "saved run's)")
