"""DDP communication hooks that send gradient buckets through a codec.

Lightning registers DDP comm hooks only on CUDA, and disttrain wraps the model in DDP itself, so the hook
is registered here, on CPU/gloo and GPU/NCCL alike. (No postponed annotations in this module: DDP checks
the hook's annotations at run time.)
"""

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from disttrain.comm.codecs import CastCodec, Int8Codec, SignCodec
from disttrain.comm.config import CommConfig
from disttrain.comm.counter import ByteCounter, ring_allreduce_bytes, ring_allreduce_messages
from disttrain.comm.exchange import Codec, ErrorFeedback, compressed_mean
from disttrain.comm.powersgd import PowerSGDExchange
from disttrain.comm.state import ExchangeState

WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def wire_dtype(config: CommConfig | None) -> torch.dtype | None:
    """The dtype gradients are cast to for the wire (fp16, bf16), else None."""
    return WIRE_DTYPES.get(config.name) if config is not None else None


def codec_of(config: CommConfig) -> Codec | None:
    """The codec of ``config`` (None: DDP's own fp32 all-reduce)."""
    if config.name in WIRE_DTYPES:
        return CastCodec(WIRE_DTYPES[config.name])
    return {"int8": Int8Codec, "onebit": SignCodec}.get(config.name, lambda: None)()


def register_compression(ddp: DistributedDataParallel, config: CommConfig, counter: ByteCounter,
                         state: ExchangeState) -> None:
    """Make ``ddp`` average its gradients through ``config``'s codec or PowerSGD, counting the bytes sent;
    ``state`` keeps what carries over between steps (residuals, PowerSGD's factors, the exchange count); the
    first ``config.warmup_steps`` exchanges are plain fp32 all-reduces."""
    group = ddp.process_group
    codec = codec_of(config)
    if config.name == "powersgd":
        state.powersgd = PowerSGDExchange(group, config.rank, config.error_feedback)
        compressed = partial(state.powersgd.mean, counter=counter)
    elif codec is not None:
        residuals = state.feedback if config.error_feedback else None
        compressed = partial(_flat_mean, codec=codec, group=group, counter=counter, residuals=residuals)
    else:
        return

    def average(grads: list[torch.Tensor]) -> torch.Tensor:
        # the hook runs once per optimiser step: DDP does not communicate on accumulation micro-batches
        warming_up = state.exchanges < config.warmup_steps
        mean = fp32_mean(grads, group, counter) if warming_up else compressed(grads)
        state.exchanges += 1
        return mean

    register_payload_hook(ddp, average)


def register_payload_hook(ddp: DistributedDataParallel,
                          average: Callable[[list[torch.Tensor]], torch.Tensor]) -> None:
    """Make ``ddp`` replace its gradients by ``average`` of them (their flat concatenation in, the flat result
    out), once per iteration, over every gradient in the model's parameter order.

    The buckets of an iteration are collected and handed over as one payload when the last one arrives: DDP
    lays its buckets out again after the first iteration of every process, and a payload (its chunks, scales
    and residuals) that followed DDP's layout would differ between a resumed process's first step and the
    uninterrupted run's.
    """
    position = {id(param): index for index, param in enumerate(ddp.module.parameters())}
    pending: list[tuple[dist.GradBucket, torch.futures.Future[torch.Tensor]]] = []

    def hook(_state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        pending.append((bucket, done))
        if bucket.is_last():
            grads = sorted(((position[id(param)], grad) for b, _ in pending
                            for param, grad in zip(b.parameters(), b.gradients(), strict=True)), key=lambda g: g[0])
            mean = average([grad for _, grad in grads])
            offset = 0
            for _, grad in grads:  # the gradients are views into the buckets' buffers
                grad.copy_(mean[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()
            for b, future in pending:
                future.set_result(b.buffer())
            pending.clear()
        return done

    ddp.register_comm_hook(None, hook)


def fp32_mean(grads: list[torch.Tensor], group: dist.ProcessGroup, counter: ByteCounter) -> torch.Tensor:
    """DDP's own exchange (each rank's gradients over the world size, summed in an fp32 all-reduce)."""
    world = dist.get_world_size(group)
    flat = torch.cat([grad.reshape(-1).float() for grad in grads]).div_(world)
    dist.all_reduce(flat, group=group)
    counter.add(ring_allreduce_bytes(flat.numel(), 4, world), ring_allreduce_messages(world))
    return flat


def _flat_mean(grads: list[torch.Tensor], codec: Codec, group: dist.ProcessGroup, counter: ByteCounter,
               residuals: ErrorFeedback | None) -> torch.Tensor:
    flat = torch.cat([grad.reshape(-1).float() for grad in grads])
    return compressed_mean(flat, codec, group, counter, residuals, "all")
