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
    return torch.cat([payload.view(torch.int8), scale.reshape(-1, 1).float().contiguous().view(torch.int8)], dim=1)


def _split_scale(wire: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = wire[:, -SCALE_BYTES:].flatten().clone().view(torch.float32)  # a fresh copy: aligned for float32
    return wire[:, :-SCALE_BYTES], scale.view(-1, 1)


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


class SignCodec:
    """One bit per value (its sign) and one float32 scale per row, the row's mean magnitude, as in 1-bit
    SGD and 1-bit Adam; only with error feedback does the mean of the decoded steps follow the gradient."""

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """Packed sign bits of ``rows`` (8 per byte) and their scales."""
        count, chunk = rows.shape
        bits = torch.zeros(count, -(-chunk // 8) * 8, dtype=torch.int32, device=rows.device)
        bits[:, :chunk] = (rows >= 0).to(torch.int32)
        packed = (bits.view(count, -1, 8) * _BIT_WEIGHTS.to(rows.device)).sum(dim=2).to(torch.uint8)
        return _with_scale(packed, rows.abs().mean(dim=1))

    def decode(self, wire: torch.Tensor, chunk: int) -> torch.Tensor:
        """+scale or -scale per value, from the packed bits."""
        packed, scale = _split_scale(wire)
        bits = (packed.view(torch.uint8).to(torch.int32).unsqueeze(2) // _BIT_WEIGHTS.to(wire.device)) % 2
        signs = bits.view(wire.shape[0], -1)[:, :chunk].float() * 2 - 1
        return signs * scale
