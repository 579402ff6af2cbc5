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
    eos_id: int | None = None
    """End-of-document id of packed windows (text data): the documents of a window end at its occurrences, and
    models keep each document to itself (``disttrain.data.mixture`` states the contract). None: a window is one
    sequence."""


def example_batch(spec: DataSpec, size: int, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets shaped like ``size`` samples of ``spec`` (for probes and plans: the values are
    random, and on the meta device there are none)."""
    if spec.kind == "text":
        tokens = torch.randint(0, spec.vocab_size or 2, (size, spec.block_size), device=device)
        return tokens, tokens
    images = torch.randn(size, spec.in_channels, spec.image_size, spec.image_size, device=device)
    return images, torch.randint(0, spec.num_classes or 2, (size,), device=device)
