"""Lightning's ``self.log`` without moving a stored value that already lies on the logged value's device.

Every ``self.log`` call moves the stored result (a ``_ResultMetric``) to the logged value's device: Lightning
maps ``move_data_to_device`` over the result's whole ``__dict__`` with ``apply_to_collection``, which
deep-copies the result's metadata dataclass on the way. On a logged training step (seven values) that was
about 11 ms of a 14 ms CNN step under a profiler, and the same walk runs again for every value on every
logged step although nothing moves after the first.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

_lightning_to = _ResultMetric.to


def _to_unless_there(self: _ResultMetric, *args: Any, **kwargs: Any) -> _ResultMetric:
    """``_ResultMetric.to``, returning at once when the result is a tensor result whose states already lie on
    the requested device (a device is all that ``self.log`` and ``_ResultCollection.cpu`` pass)."""
    target = args[0] if len(args) == 1 and not kwargs else kwargs["device"] if set(kwargs) == {"device"} and \
        not args else None
    value = getattr(self, "value", None)  # read defensively: private to Lightning, which may rename it
    if target is not None and getattr(self, "is_tensor", False) and isinstance(value, torch.Tensor):
        device = torch.device(target)
        states = (value, getattr(self, "cumulated_batch_size", value))
        if all(isinstance(t, torch.Tensor) and same_device(t.device, device) for t in states):
            return self
    return _lightning_to(self, *args, **kwargs)


def same_device(held: torch.device, asked: torch.device) -> bool:
    """Whether a tensor on ``held`` already lies on ``asked`` (``cuda`` without an index means the current one)."""
    if held.type != asked.type:
        return False
    if asked.index is None and held.type == "cuda":
        return held.index == torch.cuda.current_device()
    return asked.index is None or held.index == asked.index


def place_logged_values_once() -> None:
    """Make ``self.log`` skip the move of a stored result already on its device (idempotent; moves to another
    device, and results holding a torchmetrics ``Metric``, still go through Lightning's own ``to``)."""
    _ResultMetric.to = _to_unless_there
