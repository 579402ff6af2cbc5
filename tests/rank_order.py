"""DDP whose gradient average adds the ranks' gradients in rank order, the reference a run that averages
through point-to-point messages can equal bit for bit.

gloo's ring all-reduce adds each of its N chunks of a bucket in a different order: with 4 ranks chunk k is
((g[k-1] + g[k-2]) + g[k-3]) + g[k], indices modulo 4, so about a quarter of a bucket's elements come out a
rounding apart from the rank order. Training grows such differences by a factor that depends on the
trajectory, and the trajectory on the CPU's kernels (AVX-512, AVX2 or none): a comparison with stock DDP
holds at 1e-6 on one CPU and not on another. With the order fixed on both sides nothing is left to differ.
(No postponed annotations in this module: DDP checks the hook's annotations at run time.)"""

from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def rank_order_mean(group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: every rank's bucket gathered, added in rank order, divided by the number of ranks."""
    flat = bucket.buffer()
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, flat, group=group)
    total = gathered[0].clone()
    for values in gathered[1:]:
        total += values
    total /= len(gathered)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(total)
    return done


class RankOrderMean(pl.Callback):
    """Register ``rank_order_mean`` on the run's DDP module before the first step."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Any:
        ddp = next(m for m in pl_module.modules() if isinstance(m, DistributedDataParallel))
        ddp.register_comm_hook(ddp.process_group, rank_order_mean)
