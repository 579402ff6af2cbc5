"""A mean over ranks with compressed payloads: reduce-scatter and all-gather of encoded chunks, summed in fp32.

torch's compression hooks either all-reduce in the wire dtype (so the sum itself is rounded) or all-gather
every rank's whole payload, whose bytes grow with the number of ranks. Here each rank sends N - 1 encoded
chunks of 1/N of the payload to their owners, which decode and sum them in fp32, and sends its encoded mean
chunk back to every rank: 2 (N - 1) / N of the encoded size per rank, as a ring all-reduce, through two
all-to-alls that gloo and NCCL both run. With error feedback, what a compression leaves out of a payload
(the residual) is added to the next payload of the same bucket, on the sending side of both phases.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist

from disttrain.comm.counter import ByteCounter


class Codec(Protocol):
    """What goes on the wire for rows of float32 values (one row per destination chunk), and back."""

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """The wire form of ``rows`` (float32, shape [n, chunk]): one wire row per row."""

    def decode(self, wire: torch.Tensor, chunk: int) -> torch.Tensor:
        """float32 rows of ``chunk`` values from wire rows."""


class ErrorFeedback:
    """Residuals of the two compressions of each bucket (this rank's payload, and the chunk it owns)."""

    def __init__(self) -> None:
        self.residuals: dict[str, torch.Tensor] = {}
        """``"<bucket>/send"`` and ``"<bucket>/own"`` -> what the last compression of that payload left out."""

    def apply(self, key: str, values: torch.Tensor) -> torch.Tensor:
        """``values`` plus the residual left by the previous compression of the same payload."""
        residual = self.residuals.get(key)
        return values + residual if residual is not None and residual.shape == values.shape else values

    def keep(self, key: str, wanted: torch.Tensor, sent: torch.Tensor) -> None:
        """Remember what the compression of ``wanted`` left out."""
        self.residuals[key] = wanted - sent


def compressed_mean(values: torch.Tensor, codec: Codec, group: dist.ProcessGroup | None = None,
                    counter: ByteCounter | None = None, feedback: ErrorFeedback | None = None,
                    key: str = "0") -> torch.Tensor:
    """The mean over the ranks of ``group`` of the 1-D float32 ``values``, each payload sent encoded.
    ``feedback`` (optional) carries the residuals of payload ``key`` from one call to the next."""
    world = dist.get_world_size(group)
    chunk = -(-values.numel() // world)
    padded = torch.zeros(world, chunk, dtype=torch.float32, device=values.device)
    padded.view(-1)[: values.numel()] = values
    # reduce-scatter: chunk j goes to rank j, encoded; its owner sums the N decoded chunks in fp32
    wanted = feedback.apply(f"{key}/send", padded) if feedback is not None else padded
    sent = codec.encode(wanted)
    if feedback is not None:
        feedback.keep(f"{key}/send", wanted, codec.decode(sent, chunk))
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    own = codec.decode(received, chunk).sum(dim=0, keepdim=True) / world
    # all-gather: the owner's encoded mean chunk goes to every rank
    own_wanted = feedback.apply(f"{key}/own", own) if feedback is not None else own
    mean_wire = codec.encode(own_wanted)
    if feedback is not None:
        feedback.keep(f"{key}/own", own_wanted, codec.decode(mean_wire, chunk))
    gathered = torch.empty_like(sent)
    dist.all_to_all_single(gathered, mean_wire.expand(world, -1).contiguous(), group=group)
    if counter is not None:
        counter.add(2 * (world - 1) * sent[0].numel() * sent.element_size(), 2 * (world - 1))
    # every rank, its own chunk included, decodes what was sent: replicas stay identical
    return codec.decode(gathered, chunk).view(-1)[: values.numel()]
