"""Sizes of the transformer language models: a flavour's presets, the config's explicit sizes and the
data's spec combined into checked sizes, and the check of each input's length against them.

The text models share these rules (positive sizes, a vocabulary at least the data's, heads that divide
the width, a block size that covers the data's), so a config error reads the same whichever model it names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from disttrain.data.spec import DataSpec
from disttrain.errors import ConfigError


def resolve_dims(cfg: Any, spec: DataSpec, model: str, flavours: dict[str, dict[str, int]], keys: tuple[str, ...],
                 check_heads: Callable[[dict[str, int]], None] | None = None) -> dict[str, int]:
    """The sizes ``keys`` of a text model for ``spec``: each from ``cfg`` where set, else from the data (block
    and vocabulary size), else from ``cfg.flavour``'s preset in ``flavours``; ConfigError if impossible.

    ``model`` names the model in the error for non-text data. ``check_heads`` adds a model's own checks of
    the merged sizes; it runs once the heads are known to divide the width (so it may rely on that) and
    before the sizes are compared with the data's.
    """
    if spec.kind != "text":
        raise ConfigError("model.name", cfg.name, f"a model for {spec.kind} data; {model} needs text data")
    if cfg.flavour not in flavours:
        raise ConfigError("model.flavour", cfg.flavour, f"one of {list(flavours)}")
    for key in keys:
        value = getattr(cfg, key)
        if value is not None and value <= 0:
            raise ConfigError(f"model.{key}", value, "a positive integer, or null for the default")
    preset = flavours[cfg.flavour]
    dims = {key: getattr(cfg, key) if getattr(cfg, key) is not None else preset.get(key) for key in keys}
    if cfg.block_size is None and spec.block_size is not None:
        dims["block_size"] = spec.block_size
    if cfg.vocab_size is None and spec.vocab_size is not None:
        dims["vocab_size"] = spec.vocab_size
    if dims["vocab_size"] is None:
        raise ConfigError("model.vocab_size", None,
                          f"a vocabulary size: the data has none and flavour {cfg.flavour!r} no default")
    if dims["n_embd"] % dims["n_head"]:
        raise ConfigError("model.n_head", dims["n_head"], f"a divisor of model.n_embd={dims['n_embd']}")
    if check_heads is not None:
        check_heads(dims)
    if spec.block_size is not None and dims["block_size"] < spec.block_size:
        raise ConfigError("model.block_size", dims["block_size"],
                          f"at least the data's block size {spec.block_size}, or null to use the data's")
    if spec.vocab_size is not None and dims["vocab_size"] < spec.vocab_size:
        raise ConfigError("model.vocab_size", dims["vocab_size"],
                          f"at least the data's vocabulary {spec.vocab_size}, or null to use the data's")
    return dims


def sequence_length(idx: torch.Tensor, block_size: int) -> int:
    """The length ``T`` of token ids ``[B, T]``; ValueError when it exceeds ``block_size``."""
    t = idx.size(1)
    if t > block_size:
        raise ValueError(f"sequence length {t} exceeds the model's block_size {block_size}")
    return t
