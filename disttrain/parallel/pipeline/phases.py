"""Pipeline stages and a loss that mark the step's phases (``disttrain.observe.phases``): torch's schedule runs
them inside one call, out of sight of Lightning's hooks, so the stage says when its forward, its backward (both
halves where a zero-bubble schedule splits it) and its loss run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.pipelining import PipelineStage

from disttrain.observe.phases import PHASE_MARKS


class PhaseStage(PipelineStage):
    """A ``PipelineStage`` whose ``forward_one_chunk`` is the step's forward and whose ``backward_one_chunk``
    (input gradients, or all) and ``backward_weight_one_chunk`` (weight gradients) are its backward."""

    def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        """``PipelineStage.forward_one_chunk``, marked as forward."""
        with PHASE_MARKS.compute("forward"):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        """``PipelineStage.backward_one_chunk``, marked as backward."""
        with PHASE_MARKS.compute("backward"):
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
        """``PipelineStage.backward_weight_one_chunk``, marked as backward."""
        with PHASE_MARKS.compute("backward"):
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)


class PhaseLoss:
    """A schedule's ``loss_fn`` whose calls are marked as forward (the schedule computes the loss between the last
    stage's forward and its backward)."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        self.loss_fn = loss_fn
        """The loss of one micro-batch."""

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """``loss_fn(output, target)``, marked as forward."""
        with PHASE_MARKS.compute("forward"):
            return self.loss_fn(output, target)
