"""Checks of a batch's values on the meta device, answered as the runner's batches answer them."""

from __future__ import annotations

import torch


class WholeSequences(torch.overrides.TorchFunctionMode):
    """Answers ``all()`` of a tensor on the meta device, which has no values, with True: what it answers of the
    batches a run feeds (whole sequences of consecutive positions, no padding). ``transformers``' mask builders
    ask just that (``masking_utils``: are the positions one sequence per row, is the padding mask all ones) to
    decide that attention needs no mask; unanswered, the pass would stop there."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func in (torch.all, torch.Tensor.all) and len(args) == 1 and not kwargs
                and isinstance(args[0], torch.Tensor) and args[0].device.type == "meta"):
            return torch.tensor(True)
        return func(*args, **kwargs)
