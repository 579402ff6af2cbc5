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
    """Make ``ddp`` average its gradient buckets through ``config``'s codec, counting the bytes sent;
    ``feedback`` keeps the residuals when ``comm.error_feedback`` is on."""
    codec = codec_of(config)
    if codec is None:
        return
    group = ddp.process_group
    residuals = feedback if config.error_feedback else None

    def hook(_state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        mean = compressed_mean(buffer.float(), codec, group, counter, residuals, str(bucket.index()))
        buffer.copy_(mean)
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buffer)
        return done

    ddp.register_comm_hook(None, hook)
