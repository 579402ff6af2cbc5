"""What a data module tells the model builder about its samples."""

from __future__ import annotations

from dataclasses import dataclass


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
