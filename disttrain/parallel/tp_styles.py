"""Tensor-parallel styles that torch does not ship: grouped experts split whole, and the shared rotary key of
multi-head latent attention.

``experts``: a module holding ``[n_experts, ...]`` parameters (``transformers``' grouped experts, called as
``experts(hidden, top_k_index, top_k_weights)``) keeps ``n_experts / tp`` whole experts on each tp rank
(``Shard(0)``: every saved, loaded and gathered tensor is an ordinary DTensor slice). Every tp rank holds the
same tokens; each runs its own experts on the routes that reach them (the others are masked to the experts'
"no expert" index, which their kernels skip, with weight 0) and one all-reduce sums the partial outputs, as
Megatron's row-wise layer does. Backward sums the tokens' and routing weights' partial gradients over the tp
ranks. Splitting each expert's packed ``gate_up`` rows instead (``transformers``' ``packed_colwise``) needs a
strided DTensor layout that torch.distributed.checkpoint refuses to save ("overlapping chunks"), so disttrain
splits experts whole: the same collectives, weights and optimiser state divided by tp, exact.

``mla_kv_a``: the joint key/value down-projection of multi-head latent attention (DeepSeek-V2) stays whole on
every tp rank, but the rotary part of its output feeds every head as one shared key, and each rank attends only
with its own heads: the gradient of that part is summed over the tp ranks (its other part reaches the heads
through a column-wise layer, whose input gradient torch already sums).
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


def sum_gradient(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """``x`` unchanged, whose gradient is summed over the ranks of ``mesh`` in backward (each rank's is partial)."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def sum_over_ranks(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """The sum of each rank's partial ``x`` over ``mesh`` (all-reduce), whose gradient passes unchanged."""
    return DTensor.from_local(x, mesh, [Partial()], run_check=False).redistribute(placements=[Replicate()]).to_local()


@contextmanager
def local_parameters(module: nn.Module) -> Generator[None, None, None]:
    """Within this context ``module``'s own DTensor parameters are its local shards (differentiable views), for a
    forward written for plain tensors (``transformers``' expert kernels index and reshape them)."""
    saved = dict(module._parameters)
    for name, param in saved.items():
        if isinstance(param, DTensor):
            module._parameters[name] = param.to_local()
    try:
        yield
    finally:
        module._parameters.update(saved)


class ExpertsParallel(ParallelStyle):
    """Whole experts split over the tp ranks (see the module docstring)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        n_experts = module.num_experts
        local = n_experts // device_mesh.size()
        first = device_mesh.get_local_rank() * local

        def split(name: str, part: nn.Module, mesh: DeviceMesh) -> None:
            if part is not module:
                return
            for key, param in list(part.named_parameters(recurse=False)):
                part.register_parameter(key, nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]),
                                                          requires_grad=param.requires_grad))

        distribute_module(module, device_mesh, split)
        module.num_experts = local  # the experts' kernels count, index and mask by it
        if hasattr(module, "_is_expert_parallel"):
            # transformers' grouped kernels zero the rows of routes to "no expert" only when told (its own expert
            # parallelism sets this); without it those rows hold uninitialised memory (NaN * 0 in the sum)
            module._is_expert_parallel = True
        forward = module.forward

        def split_forward(hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                          *args: Any, **kwargs: Any) -> torch.Tensor:
            hidden, top_k_weights = sum_gradient(hidden, device_mesh), sum_gradient(top_k_weights, device_mesh)
            elsewhere = (top_k_index < first) | (top_k_index >= first + local)
            local_index = torch.where(elsewhere, local, top_k_index - first)  # ``local``: the kernels' "no expert"
            with local_parameters(module):
                out = forward(hidden, local_index, top_k_weights.masked_fill(elsewhere, 0.0), *args, **kwargs)
            return sum_over_ranks(out, device_mesh)

        module.forward = split_forward
        return module


class MlaKvAParallel(ParallelStyle):
    """A whole projection whose last ``rope_width`` output features are a key shared by every head, so their
    gradient is summed over the tp ranks (see the module docstring)."""

    def __init__(self, rope_width: int) -> None:
        super().__init__()
        self.rope_width = rope_width

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        width = self.rope_width

        def shared_rope(_: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
            kept, rope = output.split([output.shape[-1] - width, width], dim=-1)
            return torch.cat([kept, sum_gradient(rope, device_mesh)], dim=-1)

        module.register_forward_hook(shared_rope)
        return module
