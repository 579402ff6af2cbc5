"""The task's cross-entropy (``disttrain.loss``), compiled with the model when ``trainer.compile`` is on.

Under bf16 autocast ``F.cross_entropy`` runs in fp32: eager, it writes an fp32 copy of the logits, keeps an fp32
log-softmax for backward and starts backward with an fp32 gradient of the logits beside its bf16 cast. With a
large vocabulary those are the biggest tensors of a step (GPT-2 at batch 12 x 1024: 2.5 GB each) and memory
traffic that the matrix products wait on. Compiled, the upcast, log-softmax and gather fuse into one reduction
over the bf16 logits, and backward writes the bf16 gradient directly.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from disttrain.loss import token_cross_entropy
from disttrain.parallel.compile import torch_compile_mode

LossFunction = Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]
"""``(logits [..., classes], targets [...], reduction) -> loss``."""


def loss_function(compile_mode: str | None) -> LossFunction:
    """``token_cross_entropy``, compiled in torch.compile's ``compile_mode`` as the model is; None: eager."""
    if compile_mode is None:
        return token_cross_entropy
    return torch.compile(token_cross_entropy, mode=torch_compile_mode(compile_mode))
