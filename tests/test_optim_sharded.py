"""LAMB and LARS under FSDP2 sharding (2 gloo ranks) against a single-process run on the unsharded model."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from disttrain.optim import Lamb, Lars, param_groups
from tests.dist_utils import run_on_ranks

STEPS = 5
OPTIMIZERS_UNDER_TEST = {
    "lamb": (Lamb, {"lr": 0.02, "weight_decay": 0.1}),
    "lars": (Lars, {"lr": 0.5, "eta": 0.02, "weight_decay": 0.01}),
}


def _mlp() -> nn.Module:
    """Uneven shards on 2 ranks: 7 rows split 4/3, and the last layer's single row leaves rank 1 empty."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 10), nn.LayerNorm(10), nn.Tanh(), nn.Linear(10, 7), nn.Tanh(),
                         nn.Linear(7, 1))


def _train(model: nn.Module, opt: torch.optim.Optimizer, count: list[int] | None = None) -> None:
    """Five steps on the same data on every rank; ``count[0]`` += the all-reduces issued inside ``step``."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x, y = torch.randn(16, 6, generator=gen), torch.randn(16, 1, generator=gen)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if count is None:
            opt.step()
        else:
            _counted_step(opt, count)


def _counted_step(opt: torch.optim.Optimizer, count: list[int]) -> None:
    original = dist.all_reduce

    def counting(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        opt.step()
    finally:
        dist.all_reduce = original


def _sharded_worker() -> dict:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {}
    for name, (cls, kwargs) in OPTIMIZERS_UNDER_TEST.items():
        reference = _mlp()
        _train(reference, cls(param_groups(reference, kwargs["weight_decay"], adapt=True), **kwargs))
        for layout, shard_local in (("full", False), ("full", True), ("mixed", False)):
            model = _mlp()
            if layout == "mixed":  # only the first layer sharded: DTensor and plain parameters together
                fully_shard(model[0], mesh=mesh)
            else:
                for i in (0, 3, 5):
                    fully_shard(model[i], mesh=mesh)
                fully_shard(model, mesh=mesh)
            opt = cls(param_groups(model, kwargs["weight_decay"], adapt=True), **kwargs,
                      shard_local_norms=shard_local)
            count = [0]
            _train(model, opt, count)
            diffs, close = [], True
            for (_, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
                full = p.full_tensor() if isinstance(p, DTensor) else p
                diffs.append((full - q).abs().max().item())
                close &= torch.allclose(full, q, rtol=1.3e-6, atol=1e-5)
            case = {"max_diff": max(diffs), "close": bool(close), "all_reduces": count[0],
                    "sharded": sum(isinstance(p, DTensor) for p in model.parameters())}
            if layout == "full" and not shard_local:
                state = get_optimizer_state_dict(model, opt)
                case["state_keys"] = sorted(state["state"])
                fresh = cls(param_groups(model, kwargs["weight_decay"], adapt=True), **kwargs)
                set_optimizer_state_dict(model, fresh, state)
                case["state_restored"] = all(
                    torch.equal(fresh.state[p][k].full_tensor() if isinstance(v, DTensor) else fresh.state[p][k],
                                v.full_tensor() if isinstance(v, DTensor) else v)
                    for p in opt.state for k, v in opt.state[p].items()
                )
            results[f"{name}/{layout}/{'local' if shard_local else 'global'}"] = case
    return results


def test_sharded_parity_lamb_lars():
    for rank, results in enumerate(run_on_ranks(_sharded_worker, 2)):
        for name in OPTIMIZERS_UNDER_TEST:
            right, wrong, mixed = (results[f"{name}/{k}"] for k in ("full/global", "full/local", "mixed/global"))
            # Whole-parameter norms: the sharded run equals the single-process run ...
            assert right["close"], (rank, name, right)
            assert mixed["close"] and 0 < mixed["sharded"] < 8, (rank, name, mixed)
            # ... with one all-reduce per step for all 8 parameters, not one per parameter.
            assert right["sharded"] == 8 and right["all_reduces"] == STEPS, (rank, name, right)
            assert mixed["all_reduces"] == STEPS, (rank, name, mixed)
            # Norms of the local shards (the classic mistake) are caught.
            assert not wrong["close"] and wrong["max_diff"] > 1e-4, (rank, name, wrong)
            assert wrong["all_reduces"] == 0
            # The state checkpoints through torch.distributed.checkpoint.
            assert right["state_restored"] and len(right["state_keys"]) == 8, (rank, name, right)
