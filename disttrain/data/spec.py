"""What a data module tells the model builder about its samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DataSpec:
    """Shape of the data a model must fit: set by the data module, read by the model builders."""

    kind: str
    """"image" (classification of C x H x W images) or "text" (next-token prediction on token ids)."""
    num_classes: int | None = None
    """Number of target classes (image data)."""
    in_channels: int | None = None
    """Channels per image (image data)."""
    image_size: int | None = None
    """Side length of the square images (image data)."""
    vocab_size: int | None = None
    """Number of distinct token ids (text data)."""
    block_size: int | None = None
    """Length of the token sequences the data yields (text data)."""
    document_end: int | None = None
    """The token id that closes every document of windows packed from several (text data): the model then attends
    only within each document and restarts positions at each (``disttrain.models.documents``). None: each window
    is one sequence."""
    masked_targets: bool = False
    """Training targets may be ``IGNORE_INDEX`` (a prompt's tokens, padding), so micro-batches hold different
    numbers of real targets: a step's loss is then the mean over the real targets of its whole batch, counted
    over the ranks every step (``disttrain.rank.target_mean``)."""
    eval_sources: tuple[str, ...] = ()
    """Names of the sources evaluation batches are read from, where those batches are ``(inputs, targets,
    sources)`` with each target's source index: the task then logs a loss per source (``val/loss/<name>``,
    ``disttrain.rank.source_loss``). Empty: evaluation batches are ``(inputs, targets)``, one loss."""


def example_batch(spec: DataSpec, size: int, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets shaped like ``size`` samples of ``spec`` (for probes and plans: the values are
    random, and on the meta device there are none)."""
    if spec.kind == "text":
        tokens = torch.randint(0, spec.vocab_size or 2, (size, spec.block_size), device=device)
        return tokens, tokens
    images = torch.randn(size, spec.in_channels, spec.image_size, spec.image_size, device=device)
    return images, torch.randint(0, spec.num_classes or 2, (size,), device=device)
