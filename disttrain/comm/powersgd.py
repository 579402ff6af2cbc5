"""PowerSGD (Vogels et al., 2019) over one payload of all gradients, with torch's own hook doing the maths.

torch's ``powerSGD_hook`` launches the all-reduces of P and Q from callbacks of the previous all-reduce's
future. With more than one DDP bucket (DDP's first bucket is capped at 1 MiB), gloo runs those callbacks on
its own threads while the next bucket's hook launches its first all-reduce from the backward pass, so the
ranks can issue their collectives in different orders: gloo then fails with "Received data size doesn't
match expected size" (seen with eight 64 x 64 layers and 20 KiB buckets on 2 ranks). Its state (residuals,
warm-started Q) is also keyed by bucket index, and DDP lays its buckets out again after the first
iteration of every process, so a resumed process would add residuals to the wrong gradients. Here the
hook sees one bucket, built from every gradient in the model's parameter order, so its collectives run in
one fixed order and its state keeps one layout from the first step to the last, across restarts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, _should_compress, powerSGD_hook

from disttrain.comm.counter import ByteCounter, ring_allreduce_bytes, ring_allreduce_messages

MIN_COMPRESSION_RATE = 2.0
"""A matrix is sent as P and Q only when that takes at most half its values (torch's default)."""


class _PayloadBucket:
    """What ``powerSGD_hook`` reads of a ``dist.GradBucket``, over one flat payload and views of it."""

    def __init__(self, buffer: torch.Tensor, shapes: list[torch.Size]) -> None:
        self._buffer = buffer
        self._gradients, offset = [], 0
        for shape in shapes:
            numel = shape.numel()
            self._gradients.append(buffer[offset:offset + numel].view(shape))
            offset += numel

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._gradients

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


def largest_useful_rank(shapes: list[torch.Size]) -> int:
    """The largest rank at which PowerSGD still compresses one of the matrices of ``shapes`` (0: none)."""
    best = 0
    for shape in shapes:  # torch's hook views every gradient as shape[0] x the rest
        n, m = shape[0], shape.numel() // shape[0]
        best = max([best, *(r for r in range(1, min(n, m) + 1) if _should_compress(n, m, r, MIN_COMPRESSION_RATE)[0])])
    return best


class PowerSGDExchange:
    """The mean of every rank's gradients, each matrix sent as a rank-``rank`` product P Q^T from the first
    call on, with error feedback and warm-started Q (the fp32 warm-up before it is the caller's)."""

    def __init__(self, group: dist.ProcessGroup, rank: int, error_feedback: bool) -> None:
        # torch insists on 2 fp32 iterations when residuals or Q carry over, because DDP lays its buckets out
        # again after the first one; this payload keeps one layout from the first call, so none are needed
        self.state = PowerSGDState(process_group=group, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                                   min_compression_rate=MIN_COMPRESSION_RATE, use_error_feedback=error_feedback,
                                   warm_start=True, random_seed=0)
        self.state.start_powerSGD_iter = 0
        self.state.compression_stats_logging_frequency = 2**62  # torch logs its own statistics otherwise

    def mean(self, grads: list[torch.Tensor], counter: ByteCounter) -> torch.Tensor:
        """The flat fp32 mean over ranks of ``grads`` (in the model's parameter order); counts the bytes."""
        flat = torch.cat([grad.reshape(-1).float() for grad in grads])
        world = dist.get_world_size(self.state.process_group)
        before = self.state.total_numel_after_compression
        mean = powerSGD_hook(self.state, _PayloadBucket(flat, [grad.shape for grad in grads])).wait()
        sent = self.state.total_numel_after_compression - before
        # three all-reduces: the values sent whole, P and Q
        counter.add(ring_allreduce_bytes(sent, 4, world), 3 * ring_allreduce_messages(world))
        return mean

    def state_dict(self) -> dict[str, Any]:
        """What the next step depends on: the step count, the residual and the warm-started P and Q."""
        state = self.state
        return {"iter": state.iter, **{f"{name}": memory[0].clone() for name, memory in
                                       (("error", state.error_dict), ("p", state.p_memory_dict),
                                        ("q", state.q_memory_dict)) if 0 in memory}}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue from ``state_dict``'s output."""
        state = self.state
        state.iter = int(saved["iter"])
        for name, memory in (("error", state.error_dict), ("p", state.p_memory_dict), ("q", state.q_memory_dict)):
            if name in saved:
                memory[0] = saved[name].clone()
