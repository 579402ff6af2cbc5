"""Parameter groups shared by every optimiser: no weight decay (or trust ratio) on biases and norm weights."""

from __future__ import annotations

from typing import Any

from torch import nn


def param_groups(
    model: nn.Module, weight_decay: float, exclude_bias_and_norm: bool = True, adapt: bool = False
) -> list[dict[str, Any]]:
    """Split the trainable parameters of ``model`` into a decayed and an excluded group.

    With ``exclude_bias_and_norm`` the parameters with ``ndim < 2`` (biases, norm weights, scalars) get
    ``weight_decay = 0``; otherwise every parameter is decayed. With ``adapt`` each group also carries
    ``adapt`` (True for the decayed group), which LAMB and LARS read to decide whether a parameter gets
    its layer-wise trust ratio. The model may already be wrapped (DDP, FSDP2): for DTensor parameters
    ``ndim`` is the global one, so the split is the same as for the unwrapped model. Empty groups are left
    out. Frozen parameters (``requires_grad=False``) are not optimised.
    """
    decay, plain = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (plain if exclude_bias_and_norm and p.ndim < 2 else decay).append(p)
    if not decay and not plain:
        raise ValueError(f"{type(model).__name__} has no trainable parameters")
    groups = []
    for params, wd, adapted in ((decay, weight_decay, True), (plain, 0.0, False)):
        if params:
            groups.append({"params": params, "weight_decay": wd, **({"adapt": adapted} if adapt else {})})
    return groups
