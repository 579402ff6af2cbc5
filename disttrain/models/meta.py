"""Building a model on the meta device (shapes, no memory) without what its random init would cost there."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_NORMAL_FILLS = (torch.Tensor.normal_, torch.nn.init.normal_)
"""The tensor method, and ``nn.init.normal_``, which takes torch functions' overrides itself (a mode handling it
sees none of the calls inside it)."""


class _NormalFillsLeftOutOnMeta(TorchFunctionMode):
    """Returns a meta tensor as it is from ``Tensor.normal_`` (the fill of ``nn.init.normal_``, ``xavier_normal_``,
    ``kaiming_normal_``, embeddings and most transformer inits). A meta tensor holds no values to fill, and torch
    computes ``normal_`` there by a Python decomposition whose first call imports ``torch._dynamo``, a slow import in a
    process that needs nothing else of it (the job validating a run before it starts the ranks, which do)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _NORMAL_FILLS:
            filled = args[0] if args else kwargs.get("tensor")  # nn.init.normal_ passes its tensor by name
            if isinstance(filled, torch.Tensor) and filled.is_meta:
                return filled
        return func(*args, **kwargs)


@contextmanager
def on_meta_device() -> Iterator[None]:
    """Tensors and modules made inside are on the meta device, as under ``torch.device("meta")``; their normal
    fills are left out (see ``_NormalFillsLeftOutOnMeta``), every other operation runs as it would."""
    with torch.device("meta"), _NormalFillsLeftOutOnMeta():
        yield
