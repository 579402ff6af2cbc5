"""A small ResNet-style CNN for small images (8x8 digits up to 32x32 colour images)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from disttrain import checks
from disttrain.data.spec import DataSpec
from disttrain.errors import ConfigError
from disttrain.models.registry import MODELS


@dataclass
class CNNConfig:
    """Schema of ``model: cnn``: a stem conv, stages of residual basic blocks, global pooling, linear head."""

    name: str = "cnn"
    """Registry key of this model."""
    widths: list[int] = field(default_factory=lambda: [32, 64])
    """Channels of each stage, one entry per stage; every stage after the first halves the resolution."""
    blocks_per_stage: int = 1
    """Residual basic blocks in each stage."""
    sync_batchnorm: bool = False
    """Synchronise BatchNorm statistics across data-parallel ranks. Only a flag here: the model always
    uses plain BatchNorm and the runner converts it to SyncBatchNorm when it wraps the model in DDP."""
    dropout: float = 0.0
    """Dropout probability before the linear head."""
    init_weights: str | None = None
    """A safetensors file of this model's ``state_dict()`` to start from instead of the seeded initialisation
    (``disttrain.checkpoint.init_weights``); not a ``resume``: step 0, a fresh optimiser. None: the seeded init."""

    def validate(self, spec: DataSpec) -> None:
        """Raise ConfigError if this config cannot build a model for data described by ``spec``."""
        if spec.kind != "image":
            raise ConfigError("model.name", self.name, f"a model for {spec.kind} data; cnn needs image data")
        if not spec.in_channels or not spec.num_classes:
            raise ConfigError("data", spec, "image data that states in_channels and num_classes")
        if not self.widths or any(w <= 0 for w in self.widths):
            raise ConfigError("model.widths", self.widths, "a non-empty list of positive channel counts")
        if self.blocks_per_stage < 1:
            raise ConfigError("model.blocks_per_stage", self.blocks_per_stage, "a positive number of blocks")
        checks.probability("model.dropout", self.dropout)


def _conv_bn(c_in: int, c_out: int, kernel: int, stride: int) -> list[nn.Module]:
    """A bias-free convolution (``same`` padding for stride 1) followed by BatchNorm."""
    conv = nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False)
    return [conv, nn.BatchNorm2d(c_out)]


class BasicBlock(nn.Module):
    """Residual block: conv-BN-ReLU-conv-BN plus a shortcut (1x1 conv-BN where the shape changes), ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1, self.bn1 = _conv_bn(c_in, c_out, 3, stride)
        self.conv2, self.bn2 = _conv_bn(c_out, c_out, 3, 1)
        self.act = nn.ReLU()
        projected = stride != 1 or c_in != c_out
        self.shortcut = nn.Sequential(*_conv_bn(c_in, c_out, 1, stride)) if projected else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Residual transform of a feature map ``[B, c_in, H, W] -> [B, c_out, H/stride, W/stride]``."""
        out = self.act(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.act(out + self.shortcut(x))


class Head(nn.Module):
    """Global average pool, dropout and the linear classifier."""

    def __init__(self, width: int, num_classes: int, dropout: float) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits ``[B, num_classes]`` of a feature map ``[B, width, H, W]``."""
        return self.fc(self.drop(torch.flatten(self.pool(x), 1)))


class CNN(nn.Module):
    """ResNet-style classifier: ``stem -> blocks (grouped in stages) -> head``.

    ``blocks`` is the flat ``nn.ModuleList`` of residual blocks, the unit of sharding and activation
    checkpointing; the pipeline units are the stem, each block and the head (``disttrain.models.protocol``).
    """

    def __init__(
        self,
        in_channels: int,
        num_classes: int,
        widths: list[int],
        blocks_per_stage: int = 1,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(*_conv_bn(in_channels, widths[0], 3, 1), nn.ReLU())
        blocks: list[nn.Module] = []
        c_in = widths[0]
        for s, width in enumerate(widths):
            for b in range(blocks_per_stage):
                stride = 2 if s > 0 and b == 0 else 1
                blocks.append(BasicBlock(c_in, width, stride))
                c_in = width
        self.blocks = nn.ModuleList(blocks)
        self.head = Head(widths[-1], num_classes, dropout)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """He init of the convolutions, unit BatchNorm; draws only from the global torch RNG."""
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(module, nn.BatchNorm2d):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.01)
                nn.init.zeros_(module.bias)

    def pipeline_units(self) -> list[str]:
        """Stem, each residual block, head: applied in turn they are ``forward``."""
        return ["stem", "blocks", "head"]

    def shard_units(self) -> list[str]:
        """One FSDP unit (and activation-checkpointing unit) per residual block."""
        return ["blocks"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Class logits ``[B, num_classes]`` of images ``[B, C, H, W]``."""
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@MODELS.register("cnn", CNNConfig)
def build_cnn(cfg: CNNConfig, spec: DataSpec) -> CNN:
    """Build the CNN that ``cfg`` describes for the images of ``spec``."""
    cfg.validate(spec)
    assert spec.in_channels is not None and spec.num_classes is not None
    return CNN(spec.in_channels, spec.num_classes, list(cfg.widths), cfg.blocks_per_stage, cfg.dropout)
