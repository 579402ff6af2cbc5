"""Expert parallelism: each of ``ep`` ranks holds ``n_experts / ep`` of every mixture layer's experts, and token
rows travel to their experts' rank and back by all-to-all.

Layout. ``ep`` consecutive ranks of dp_shard split the experts (``ParallelDims.expert_meshes``); an expert weight
``[n_experts, ...]`` becomes a DTensor sharded on dim 0 over that ep mesh, so checkpoints hold whole weights under
their usual names and resume under any ep. FSDP then shards each expert over the remaining ``dp_shard / ep x cp``
ranks (a unit of its own, ``expert_units``); everything else is sharded over ``dp_shard x cp`` as without ep.

One exchange (``ExpertParallel.exchange``): rows arrive sorted by global expert. The ranks first swap how many rows
each sends to each of the other's experts (an all-to-all of counts), then the rows themselves (an all-to-all whose
backward is the reverse all-to-all); the received rows, grouped by source rank, are regrouped by local expert,
computed, put back in arrival order and returned by the reverse all-to-all, so every row comes back to its place.

Gradients. The gradient of an expert's weights on its rank sums the contributions of the tokens of all ep ranks
(the all-to-all's backward brings them). The step's gradient is the mean over all ``dp x cp`` ranks' losses;
FSDP averages each expert over its ``dp x cp / ep`` sharding ranks, so the weights' gradient is scaled by 1 / ep
on the way (``_ScaleGradient``): gloo has no pre-scaled reduction for FSDP's own divide factor.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor


class _AllToAll(torch.autograd.Function):
    """All-to-all of rows with given split sizes; backward sends the gradients back the same way reversed. The
    bytes this rank sends to other ranks are added to ``exchange.sent_bytes``."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, received: list[int], sent: list[int], exchange: ExpertParallel
                ) -> torch.Tensor:
        ctx.received, ctx.sent, ctx.exchange = received, sent, exchange
        return exchange.all_to_all(rows, received, sent)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.exchange.all_to_all(grad, ctx.sent, ctx.received), None, None, None


class _ScaleGradient(torch.autograd.Function):
    """Identity whose gradient is multiplied by ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.scale, None


class ExpertParallel:
    """This rank's share of the experts and the exchange of rows with the other ranks of its ep group."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int) -> None:
        self.group = group
        """The ep ranks' process group."""
        self.rank = rank
        """This rank's index in it: it holds experts ``rank * local ... (rank + 1) * local - 1``."""
        self.size = size
        """Ranks the experts are split over."""
        self.sent_bytes = 0
        """Bytes of rows and gradients this rank has sent to the other ep ranks (forward and backward)."""

    def all_to_all(self, rows: torch.Tensor, received: list[int], sent: list[int]) -> torch.Tensor:
        """Send ``sent[r]`` rows of ``rows`` (in order) to ep rank r; return the ``received[r]`` rows from each."""
        out = rows.new_empty((sum(received), *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), received, sent, group=self.group)
        row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
        self.sent_bytes += (sum(sent) - sent[self.rank]) * row_bytes
        return out

    def __deepcopy__(self, memo: dict) -> ExpertParallel:
        # a process group cannot be copied; copies of a model (pipeline stages) share the one exchange
        return self

    def local_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's experts' rows of a weight split over the ep ranks (a DTensor sharded on dim 0), with its
        gradient scaled by 1 / ep (module docstring)."""
        local = weight.to_local() if isinstance(weight, DTensor) else weight
        return _ScaleGradient.apply(local, 1.0 / self.size)

    def exchange(self, rows: torch.Tensor, counts: torch.Tensor,
                 compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``rows`` sorted by expert (``counts[e]`` for expert ``e``) computed by ``compute(rows, counts)`` on the
        ranks that hold their experts, returned in their order."""
        per_rank = counts.view(self.size, -1)  # [ep ranks, experts per rank]: what this rank sends to each
        received_counts = torch.empty_like(per_rank)
        dist.all_to_all_single(received_counts, per_rank, group=self.group)  # [source rank, local expert]
        sent = per_rank.sum(1).tolist()
        received = received_counts.sum(1).tolist()
        arrived = _AllToAll.apply(rows, received, sent, self)
        # arrived rows are grouped by source rank, then local expert: a stable sort by local expert regroups them
        local_experts = received_counts.size(1)
        expert_of_row = torch.arange(local_experts, device=rows.device).repeat(self.size).repeat_interleave(
            received_counts.reshape(-1))
        order = torch.argsort(expert_of_row, stable=True)
        computed = compute(arrived[order], received_counts.sum(0))
        back = torch.empty_like(order)
        back[order] = torch.arange(order.numel(), device=order.device)
        return _AllToAll.apply(computed[back], sent, received, self)


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that hold grouped experts (they have an ``expert_parallel`` attribute)."""
    return [m for m in model.modules() if hasattr(m, "expert_parallel")]


def apply_expert_parallel(model: nn.Module, ep_mesh: DeviceMesh) -> list[nn.Module]:
    """Split every grouped-experts module of ``model`` over ``ep_mesh`` (weights sharded on their expert dim) and
    give it the exchange; returns those modules (FSDP units of their own, see ``expert_units``)."""
    exchange = ExpertParallel(ep_mesh.get_group(), ep_mesh.get_local_rank(), ep_mesh.size())
    modules = expert_modules(model)
    for module in modules:
        for name, param in list(module.named_parameters(recurse=False)):
            split = distribute_tensor(param.data, ep_mesh, [Shard(0)], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(split, requires_grad=param.requires_grad))
        module.expert_parallel = exchange
    return modules
