"""Parameter groups shared by every optimiser: no weight decay (or trust ratio) on biases and norm weights."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from disttrain.optim.norms import is_dtensor

FUSED_DEVICES = ("cpu", "cuda")
FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


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


def kernel_options(groups: list[dict[str, Any]]) -> dict[str, bool]:
    """``{"fused": True}`` where torch's fused AdamW kernel applies to every parameter, else ``{}`` (torch's
    default). On a CPU torch defaults to one small kernel per tensor and operation, a share of a small GPT's
    step that the fused kernel mostly saves (benchmarks/README.md, Figures cited elsewhere). Fused needs one
    device type it supports, float parameters, and plain tensors only or DTensors only (one fused call takes all
    of a group's tensors)."""
    params = [p for group in groups for p in group["params"]]
    devices = {p.device.type for p in params}
    distributed = {is_dtensor(p) for p in params}
    if len(devices) == 1 and devices <= set(FUSED_DEVICES) and len(distributed) == 1 \
            and all(p.dtype in FUSED_DTYPES for p in params):
        return {"fused": True}
    return {}


def drops_steps_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` can drop a step on the device, from a flag tensor it reads in its own kernel (its
    ``found_inf`` attribute, as ``torch.amp.GradScaler`` sets it): torch's fused Adam, AdamW and SGD, which then
    leave parameters, moments and step counts as they were without the host reading the flag."""
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)) and all(
        group.get("fused") for group in optimizer.param_groups)
