"""Codecs: how a row of float32 gradient values is sent, and read back.

Quantised rows carry the float32 scales of their blocks (``SCALE_BLOCK`` values each) in their last bytes, so
every row of a payload has the same byte length and one all-to-all moves values and scales together.
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


SCALE_BLOCK = 256
"""Values per float32 scale of the int8 and onebit codecs. One scale for a whole chunk (half the model on 2
ranks) sizes every gradient by the chunk's largest or mean magnitude: int8 rounds most values to 0 or one grid
step, onebit sends them all at one size, so Adam's per-value normalisation sees one magnitude everywhere and
tensors with smaller gradients barely move. A scale per 256 values keeps each region's own size for 4 bytes
per 256 values (int8: 1.6% more bytes; onebit: 1.125 bits a value instead of 1)."""


def _blocks(rows: torch.Tensor, block: int) -> torch.Tensor:
    """``rows`` [n, chunk] as [n, blocks, block], the last block padded with zeros."""
    count, chunk = rows.shape
    blocks = -(-chunk // block)
    padded = torch.zeros(count, blocks * block, dtype=torch.float32, device=rows.device)
    padded[:, :chunk] = rows
    return padded.view(count, blocks, block)


def _per_value(scale: torch.Tensor, block: int, chunk: int) -> torch.Tensor:
    """Each block's scale repeated for its values: [n, blocks] -> [n, chunk]."""
    return scale.repeat_interleave(block, dim=1)[:, :chunk]


class Int8Codec:
    """8-bit integers with a scale per block of ``block`` values (the block's largest magnitude / 127) and
    stochastic rounding, so a value's expected decoding is the value itself. Draws come from torch's global
    generator, which the checkpoint carries."""

    def __init__(self, block: int = SCALE_BLOCK) -> None:
        self.block = block

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """int8 codes of ``rows`` and their blocks' scales."""
        scale = _blocks(rows, self.block).abs().amax(dim=2).clamp_min(torch.finfo(torch.float32).tiny) / 127
        scaled = rows / _per_value(scale, self.block, rows.shape[1])
        codes = torch.floor(scaled + torch.rand_like(scaled)).clamp_(-127, 127).to(torch.int8)
        return _with_scale(codes, scale)

    def decode(self, wire: torch.Tensor, chunk: int) -> torch.Tensor:
        """float32 values of int8 rows."""
        codes, scale = _split_scale(wire, -(-chunk // self.block))
        return codes.float() * _per_value(scale, self.block, chunk)


_BIT_WEIGHTS = 2 ** torch.arange(8, dtype=torch.int32)


class SignCodec:
    """One bit per value (its sign) and one float32 scale per block of ``block`` values, the block's mean
    magnitude, as in 1-bit SGD and 1-bit Adam; only with error feedback does the mean of the decoded steps
    follow the gradient."""

    def __init__(self, block: int = SCALE_BLOCK) -> None:
        self.block = block

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """Packed sign bits of ``rows`` (8 per byte) and their blocks' scales."""
        count, chunk = rows.shape
        bits = torch.zeros(count, -(-chunk // 8) * 8, dtype=torch.int32, device=rows.device)
        bits[:, :chunk] = (rows >= 0).to(torch.int32)
        packed = (bits.view(count, -1, 8) * _BIT_WEIGHTS.to(rows.device)).sum(dim=2).to(torch.uint8)
        sums = _blocks(rows.abs(), self.block).sum(dim=2)
        sizes = torch.full((sums.shape[1],), float(self.block), device=rows.device)
        sizes[-1] = chunk - (sums.shape[1] - 1) * self.block  # a short last block: the mean over its values
        return _with_scale(packed, sums / sizes)

    def decode(self, wire: torch.Tensor, chunk: int) -> torch.Tensor:
        """+scale or -scale per value, from the packed bits and the blocks' scales."""
        packed, scale = _split_scale(wire, -(-chunk // self.block))
        bits = (packed.view(torch.uint8).to(torch.int32).unsqueeze(2) // _BIT_WEIGHTS.to(wire.device)) % 2
        signs = bits.view(wire.shape[0], -1)[:, :chunk].float() * 2 - 1
        return signs * _per_value(scale, self.block, chunk)
