"""A mean over ranks with compressed payloads: reduce-scatter and all-gather of encoded chunks, summed in fp32.

torch's compression hooks either all-reduce in the wire dtype (so the sum itself is rounded, and gloo's
bf16 support was missing when they were written) or all-gather every rank's whole payload, whose bytes
grow with the number of ranks. Here each rank sends N - 1 encoded chunks of 1/N of the payload to their
owners, which decode and sum them in fp32, and sends its encoded mean chunk back to every rank: 2 (N - 1) / N
of the encoded size per rank, as a ring all-reduce, through two all-to-alls that gloo and NCCL both run.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from disttrain.comm.counter import ByteCounter


class Codec(Protocol):
    """What goes on the wire for a float32 tensor, and back."""

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """The wire form of ``values`` (float32)."""

    def decode(self, wire: torch.Tensor) -> torch.Tensor:
        """float32 values of a wire tensor."""


class CastCodec:
    """Sends values cast to ``dtype`` (fp16 or bf16); decoding casts back to fp32."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` in the wire dtype."""
        return values.to(self.dtype)

    def decode(self, wire: torch.Tensor) -> torch.Tensor:
        """The wire values as float32."""
        return wire.float()


def compressed_mean(values: torch.Tensor, codec: Codec, group: dist.ProcessGroup | None = None,
                    counter: ByteCounter | None = None) -> torch.Tensor:
    """The mean over the ranks of ``group`` of the 1-D float32 ``values``, each payload sent encoded."""
    world = dist.get_world_size(group)
    chunk = -(-values.numel() // world)
    padded = torch.zeros(chunk * world, dtype=torch.float32, device=values.device)
    padded[: values.numel()] = values
    # reduce-scatter: chunk j goes to rank j, encoded; its owner sums the N decoded chunks in fp32
    sent = codec.encode(padded)
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    own = codec.decode(received).view(world, chunk).sum(dim=0) / world
    # all-gather: the owner's encoded mean chunk goes to every rank
    mean_wire = codec.encode(own)
    gathered = torch.empty(world * mean_wire.numel(), dtype=mean_wire.dtype, device=values.device)
    dist.all_to_all_single(gathered, mean_wire.repeat(world), group=group)
    if counter is not None:
        counter.add((world - 1) * (sent.numel() // world) * sent.element_size()
                    + (world - 1) * mean_wire.numel() * mean_wire.element_size())
    # every rank, its own chunk included, decodes what was sent: replicas stay identical
    return codec.decode(gathered)[: values.numel()]
