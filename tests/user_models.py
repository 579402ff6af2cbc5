"""Models and data as a user writes them, outside the package: built by ``model._target_`` and
``data._target_`` in the tests.

``PlainDecoder`` is a small transformer language model under its own names that declares nothing;
``Decoder`` is the same model declaring its parallel plan by the protocol's methods. ``small_resnet``
stands for a third-party model factory (a function taking ``**kwargs``, as torchvision's are).
``digit_splits`` is a user's data function over scikit-learn's digits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Embed(nn.Module):
    """Token plus position embeddings."""

    def __init__(self, vocab_size: int, block_size: int, width: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(block_size, width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``[B, T]`` ids to ``[B, T, width]``."""
        return self.tokens(ids) + self.positions(torch.arange(ids.size(1), device=ids.device))


class SelfAttention(nn.Module):
    """Causal attention; the head count follows from the (possibly sharded) projection width."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_width = width // heads
        self.query, self.key, self.value = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, C]`` to ``[B, T, C]``."""
        b, t, _ = x.shape
        q, k, v = (lin(x).view(b, t, -1, self.head_width).transpose(1, 2) for lin in (self.query, self.key, self.value))
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))


class Layer(nn.Module):
    """Pre-norm residual attention and feed-forward."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(width), SelfAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.ff = nn.Sequential()
        self.ff.up, self.ff.act, self.ff.down = nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, C]`` to ``[B, T, C]``."""
        x = x + self.attn(self.norm1(x))
        return x + self.ff(self.norm2(x))


class PlainDecoder(nn.Module):
    """A decoder-only language model that declares no parallel plan."""

    def __init__(self, vocab_size: int, block_size: int, width: int = 32, heads: int = 2, depth: int = 4) -> None:
        super().__init__()
        self.embed = Embed(vocab_size, block_size, width)
        self.layers = nn.ModuleList(Layer(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.heads = heads

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Next-token logits ``[B, T, vocab]``."""
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


PLAN = {"layers.*.attn.query": "colwise", "layers.*.attn.key": "colwise", "layers.*.attn.value": "colwise",
        "layers.*.attn.out": "rowwise", "layers.*.ff.up": "colwise", "layers.*.ff.down": "rowwise",
        "embed": "sequence_split", "layers.*.norm1": "sequence_norm", "layers.*.attn": "sequence_gather",
        "layers.*.norm2": "sequence_norm", "layers.*.ff": "sequence_gather", "norm": "sequence_norm",
        "head": "sequence_gather"}
"""The Megatron plan of the decoder (what ``Decoder.tp_plan`` returns, and what a config may give)."""
UNITS = ["embed", "layers", "norm", "head"]
"""Its pipeline units."""


class Decoder(PlainDecoder):
    """The same model, declaring its plan by the protocol's methods."""

    def tp_plan(self) -> dict[str, str]:
        """Attention and feed-forward split Megatron-style."""
        return dict(PLAN)

    def tp_sizes(self) -> dict[str, int]:
        """Whole heads on every tp rank."""
        return {"model.heads": self.heads}

    def pipeline_units(self) -> list[str]:
        """Embeddings, each layer, norm, head."""
        return list(UNITS)


def small_resnet(*, num_classes: int = 1000, **kwargs: object) -> nn.Module:
    """A residual image classifier from plain torch modules, as a model zoo's factory returns it."""
    in_channels = int(kwargs.get("in_channels", 3))
    width = int(kwargs.get("width", 16))
    return nn.Sequential(
        nn.Conv2d(in_channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(2 * width), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, num_classes),
    )


def digit_splits(train_size: int = 1400, seed: int = 0) -> dict:
    """scikit-learn's 8x8 digits as plain ``TensorDataset`` splits, scaled to [0, 1]; no test split."""
    from sklearn.datasets import load_digits
    from torch.utils.data import TensorDataset

    pixels, labels = load_digits(return_X_y=True)
    images = torch.tensor(pixels, dtype=torch.float32).view(-1, 1, 8, 8) / 16
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    train, val = order[:train_size], order[train_size:]
    targets = torch.tensor(labels)
    return {"train": TensorDataset(images[train], targets[train]), "val": TensorDataset(images[val], targets[val])}


class ReadsItsWeights(nn.Module):
    """A constructor that reads tensor values (it cannot run on the meta device)."""

    def __init__(self, num_classes: int, in_channels: int, image_size: int) -> None:
        super().__init__()
        self.fc = nn.Linear(in_channels * image_size * image_size, num_classes)
        if float(self.fc.weight.abs().sum()) == 0:  # .item() of a meta tensor raises
            raise ValueError("degenerate initialisation")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits of flattened images."""
        return self.fc(x.flatten(1))
