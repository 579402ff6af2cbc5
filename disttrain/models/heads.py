"""Where a model's attention projections keep their heads: declared by the model (``attention_heads()``, see
``disttrain.models.protocol``), read by a matrix optimiser that steps each head's block as its own matrix.

A projection's weight stacks its heads as blocks of ``width`` (the head dimension) along one axis: the rows of a
query, key or value projection (its output features, fused q/k/v alike, and a grouped-query model's key/value
projections with fewer blocks), the columns of the output projection (its input features).
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

from torch import Tensor, nn

ROWS, COLUMNS = 0, 1
"""The axes of a ``[out_features, in_features]`` weight along which its heads are stacked."""


@dataclass(frozen=True)
class HeadBlocks:
    """A projection's heads: blocks of ``width`` values along ``axis`` (``ROWS`` or ``COLUMNS``) of its weight."""

    axis: int
    """``ROWS`` (0: the heads are output features) or ``COLUMNS`` (1: input features)."""
    width: int
    """The width of one head's block (the head dimension)."""

    def count(self, shape: tuple[int, ...]) -> int:
        """How many heads a weight of ``shape`` holds."""
        return shape[self.axis] // self.width

    def block_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The shape of one head's matrix in a weight of ``shape``."""
        return (self.width, shape[COLUMNS]) if self.axis == ROWS else (shape[ROWS], self.width)


def head_blocks_of(model: nn.Module) -> dict[str, HeadBlocks]:
    """Parameter name (as ``model.named_parameters()`` gives it) -> its heads, for the parameters that the
    outermost module declaring ``attention_heads()`` (the model, under whatever wraps it) names; empty where none
    does. The declaration's patterns match a parameter's dotted name part by part (``blocks.*.attn.q.weight``)."""
    for prefix, module in model.named_modules():
        declare = getattr(module, "attention_heads", None)
        if callable(declare):
            patterns = declare()
            found = {}
            for name, _ in module.named_parameters():
                parts = name.split(".")
                for pattern, blocks in patterns.items():
                    pattern_parts = pattern.split(".")
                    if len(parts) == len(pattern_parts) and all(
                            fnmatchcase(n, p) for n, p in zip(parts, pattern_parts, strict=True)):
                        found[f"{prefix}.{name}".lstrip(".")] = blocks
            return found
    return {}


def to_heads(matrix: Tensor, blocks: HeadBlocks) -> Tensor:
    """The stack ``[heads, *block_shape]`` of ``matrix``'s head blocks (a copy where the axis is the columns)."""
    rows, cols = matrix.shape
    if blocks.axis == ROWS:
        return matrix.reshape(rows // blocks.width, blocks.width, cols)
    return matrix.reshape(rows, cols // blocks.width, blocks.width).transpose(0, 1)


def from_heads(stack: Tensor, blocks: HeadBlocks) -> Tensor:
    """The matrix whose head blocks ``stack`` holds (``to_heads``' inverse)."""
    heads, block_rows, block_cols = stack.shape
    if blocks.axis == ROWS:
        return stack.reshape(heads * block_rows, block_cols)
    return stack.transpose(0, 1).reshape(block_rows, heads * block_cols)
