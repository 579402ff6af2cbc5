"""DDP communication hooks that send gradient buckets through a codec.

Lightning registers DDP comm hooks only on CUDA, and disttrain wraps the model in DDP itself, so the hook
is registered here, on CPU/gloo and GPU/NCCL alike. (No postponed annotations in this module: DDP checks
the hook's annotations at run time.)
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from disttrain.comm.codecs import CastCodec, Int8Codec, SignCodec
from disttrain.comm.config import CommConfig
from disttrain.comm.counter import ByteCounter
from disttrain.comm.exchange import Codec, ErrorFeedback, compressed_mean

WIRE_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def codec_of(config: CommConfig) -> Codec | None:
    """The codec of ``config`` (None: DDP's own fp32 all-reduce)."""
    if config.name in WIRE_DTYPES:
        return CastCodec(WIRE_DTYPES[config.name])
    return {"int8": Int8Codec, "onebit": SignCodec}.get(config.name, lambda: None)()


def register_compression(ddp: DistributedDataParallel, config: CommConfig, counter: ByteCounter,
                         feedback: ErrorFeedback | None = None) -> None:
    """Make ``ddp`` average its gradients through ``config``'s codec, counting the bytes sent; ``feedback``
    keeps the residuals when ``comm.error_feedback`` is on.

    The buckets of an iteration are collected and exchanged as one payload in the model's parameter order
    when the last one arrives: DDP lays its buckets out again after the first iteration of every process,
    and a payload (its chunks, scales and residuals) that followed DDP's layout would differ between a
    resumed process's first step and the uninterrupted run's.
    """
    codec = codec_of(config)
    if codec is None:
        return
    group = ddp.process_group
    residuals = feedback if config.error_feedback else None
    position = {id(param): index for index, param in enumerate(ddp.module.parameters())}
    pending: list[tuple[dist.GradBucket, torch.futures.Future[torch.Tensor]]] = []

    def hook(_state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        pending.append((bucket, done))
        if bucket.is_last():
            grads = sorted(((position[id(param)], grad) for b, _ in pending
                            for param, grad in zip(b.parameters(), b.gradients(), strict=True)), key=lambda g: g[0])
            flat = torch.cat([grad.reshape(-1).float() for _, grad in grads])
            mean = compressed_mean(flat, codec, group, counter, residuals, "all")
            offset = 0
            for _, grad in grads:  # the gradients are views into the buckets' buffers
                grad.copy_(mean[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()
            for b, future in pending:
                future.set_result(b.buffer())
            pending.clear()
        return done

    ddp.register_comm_hook(None, hook)
