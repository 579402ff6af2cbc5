"""Codecs: how a row of float32 gradient values is sent, and read back.

Quantised rows carry their float32 scale in their last four bytes, so every row of a payload has the same
byte length and one all-to-all moves values and scales together.
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4


class CastCodec:
    """Values cast to ``dtype`` (fp16 or bf16); decoding casts back to fp32."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` in the wire dtype."""
        return rows.to(self.dtype)

    def decode(self, wire: torch.Tensor, chunk: int) -> torch.Tensor:
        """The wire values as float32."""
        return wire.float()


def _with_scale(payload: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Wire rows: ``payload``'s bytes, then the float32 ``scale`` values of each row ([rows, scales])."""
    scales = scale.reshape(payload.shape[0], -1).float().contiguous()
    return torch.cat([payload.view(torch.int8), scales.view(torch.int8)], dim=1)


def _split_scale(wire: torch.Tensor, scales: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``_with_scale``'s payload bytes and its ``scales`` float32 scales per row."""
    tail = scales * SCALE_BYTES
    scale = wire[:, -tail:].flatten().clone().view(torch.float32)  # a fresh copy: aligned for float32
    return wire[:, :-tail], scale.view(wire.shape[0], scales)


class Int8Codec:
    """8-bit integers with a per-row scale (the row's largest magnitude / 127) and stochastic rounding, so a
    value's expected decoding is the value itself. Draws come from torch's global generator, which the
    checkpoint carries."""

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """int8 codes of ``rows`` and their scales."""
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
        scaled = rows / scale
        codes = torch.floor(scaled + torch.rand_like(scaled)).clamp_(-127, 127).to(torch.int8)
        return _with_scale(codes, scale)

    def decode(self, wire: torch.Tensor, chunk: int) -> torch.Tensor:
        """float32 values of int8 rows."""
        codes, scale = _split_scale(wire)
        return codes.float() * scale


_BIT_WEIGHTS = 2 ** torch.arange(8, dtype=torch.int32)


SIGN_BLOCK = 256
"""Values per scale of the onebit codec. One mean magnitude for a whole chunk (half the model on 2 ranks) gives
every gradient the same size on the wire, so Adam's per-value normalisation sees one magnitude everywhere:
tensors whose gradients are smaller than the chunk's mean barely move. A scale per 256 values keeps each
region's own size for 4 more bytes per 32 (1.125 bits a value)."""


class SignCodec:
    """One bit per value (its sign) and one float32 scale per block of ``block`` values, the block's mean
    magnitude, as in 1-bit SGD and 1-bit Adam; only with error feedback does the mean of the decoded steps
    follow the gradient."""

    def __init__(self, block: int = SIGN_BLOCK) -> None:
        self.block = block

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """Packed sign bits of ``rows`` (8 per byte) and their blocks' scales."""
        count, chunk = rows.shape
        bits = torch.zeros(count, -(-chunk // 8) * 8, dtype=torch.int32, device=rows.device)
        bits[:, :chunk] = (rows >= 0).to(torch.int32)
        packed = (bits.view(count, -1, 8) * _BIT_WEIGHTS.to(rows.device)).sum(dim=2).to(torch.uint8)
        blocks = -(-chunk // self.block)
        magnitudes = torch.zeros(count, blocks * self.block, dtype=torch.float32, device=rows.device)
        magnitudes[:, :chunk] = rows.abs()
        sizes = torch.full((blocks,), float(self.block), device=rows.device)
        sizes[-1] = chunk - (blocks - 1) * self.block  # the last block may be short: its mean is over its values
        return _with_scale(packed, magnitudes.view(count, blocks, self.block).sum(dim=2) / sizes)

    def decode(self, wire: torch.Tensor, chunk: int) -> torch.Tensor:
        """+scale or -scale per value, from the packed bits and the blocks' scales."""
        packed, scale = _split_scale(wire, -(-chunk // self.block))
        bits = (packed.view(torch.uint8).to(torch.int32).unsqueeze(2) // _BIT_WEIGHTS.to(wire.device)) % 2
        signs = bits.view(wire.shape[0], -1)[:, :chunk].float() * 2 - 1
        return signs * scale.repeat_interleave(self.block, dim=1)[:, :chunk]
