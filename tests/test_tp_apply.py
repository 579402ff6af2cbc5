"""Tensor (and sequence) parallelism: plain training loops on gloo ranks equal one process.

A micro GPT (tied LM head, no dropout) trains 10 steps with AdamW on fixed random token batches. With tp=2
both ranks see the whole batch; per-step losses and the first step's gradients (DTensor gradients gathered
to full tensors) match a single process. On 4 ranks FSDP2 over dp_shard=2 is put on top of tp=2, each dp
rank training on its half of the global batch. The references run in the test process.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from disttrain.errors import ConfigError
from disttrain.models.cnn import CNN
from disttrain.models.gpt import GPT, GPTDims
from disttrain.optim import param_groups
from disttrain.parallel.fsdp import apply_fsdp
from disttrain.parallel.tp import apply_tp, check_tp_plan
from tests.dist_utils import run_on_ranks

DIMS = GPTDims(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
STEPS, BATCH = 10, 8
# measured (fp32, gloo): losses within 2.3e-7 relative, first-step gradients within 3.4e-8 absolute; AdamW
# hides a gradient scale from the losses, so the gradients themselves are compared
LOSS_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-5, 1e-7


def make_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(DIMS, dropout=0.0)


def batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, DIMS.vocab_size, (BATCH, DIMS.block_size + 1), generator=gen) for _ in range(STEPS)]


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
            for name, p in model.named_parameters()}


def train(model: nn.Module, dp_rank: int = 0, dp: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Global-batch loss per step (averaged over the dp ranks) and the gradients of the first step."""
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)
    losses, grads = [], {}
    for step, data in enumerate(batches()):
        rows = data[dp_rank * BATCH // dp:(dp_rank + 1) * BATCH // dp]
        opt.zero_grad()
        logits = model(rows[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, DIMS.vocab_size), rows[:, 1:].reshape(-1))
        loss.backward()
        if step == 0:  # under FSDP the whole gradient is the mean over the dp ranks' halves
            grads = full_grads(model)
        opt.step()
        total = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(total)  # tp peers hold the same loss, so the mean over all ranks is the dp mean
            total /= dist.get_world_size()
        losses.append(total.item())
    return losses, grads


def _tp_worker() -> dict:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    out = {}
    for sp in (False, True):
        model = apply_tp(make_gpt(), mesh, make_gpt().tp_plan(), sequence_parallel=sp)
        losses, grads = train(model)
        # numpy arrays pickle by value (tensors would be shared through this process's file descriptors)
        out[sp] = {"losses": losses, "grads": {k: g.numpy() for k, g in grads.items()}, "tied": model.tied,
                   "sharded": isinstance(model.blocks[0].attn.q.weight, DTensor)}
    return out


def _fsdp_tp_worker() -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    out = {}
    for sp in (False, True):
        model = apply_tp(make_gpt(), mesh["tp"], make_gpt().tp_plan(), sequence_parallel=sp)
        apply_fsdp(model, mesh["dp_shard"], reshard_after_forward=True)
        losses, grads = train(model, mesh["dp_shard"].get_local_rank(), 2)
        out[sp] = {"losses": losses, "grads": {k: g.numpy() for k, g in grads.items()}}
    return out


@functools.cache
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train(make_gpt())
    finally:
        torch.set_num_threads(threads)


def assert_losses_close(losses: list[float], expected: list[float]) -> None:
    assert len(losses) == len(expected)
    for step, (got, want) in enumerate(zip(losses, expected, strict=True)):
        assert got == pytest.approx(want, rel=LOSS_RTOL), f"step {step}: {got} != {want}"


@pytest.fixture(scope="module")
def tp_results() -> list[dict]:
    return run_on_ranks(_tp_worker, 2)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_tp_matches_single_process(tp_results: list[dict], sp: bool) -> None:
    ref_losses, ref_grads = reference()
    for rank, result in enumerate(tp_results):
        got = result[sp]
        assert got["sharded"] and got["tied"], rank
        assert_losses_close(got["losses"], ref_losses)
        assert got["grads"].keys() == ref_grads.keys()
        for name, grad in got["grads"].items():
            torch.testing.assert_close(torch.from_numpy(grad), ref_grads[name], rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                       msg=name)


def test_fsdp_over_tp_matches_single_process() -> None:
    ref_losses, ref_grads = reference()
    for result in run_on_ranks(_fsdp_tp_worker, 4):
        for sp in (False, True):
            assert_losses_close(result[sp]["losses"], ref_losses)
            assert result[sp]["grads"].keys() == ref_grads.keys()
            for name, grad in result[sp]["grads"].items():
                torch.testing.assert_close(torch.from_numpy(grad), ref_grads[name], rtol=GRAD_RTOL, atol=GRAD_ATOL,
                                           msg=name)


def test_plan_and_divisibility_checks() -> None:
    gpt = make_gpt()  # 2 heads of width 16, MLP width 128
    plan = gpt.tp_plan()
    check_tp_plan(gpt, plan, 2, True, "tp_plan()")
    with pytest.raises(ConfigError, match="model.n_head=2 is invalid: divisible by parallel.tp=4"):
        check_tp_plan(gpt, plan, 4, False, "tp_plan()")
    with pytest.raises(ConfigError, match="parallel.tp=4 .*a divisor of the 6 output features of 0 .colwise"):
        check_tp_plan(nn.Sequential(nn.Linear(4, 6)), {"0": "colwise"}, 4, False, "parallel.tp_plan")
    with pytest.raises(ConfigError, match=r"parallel.tp_plan\[blocks.\*.attn.qq\].*matches none"):
        check_tp_plan(gpt, {"blocks.*.attn.qq": "colwise"}, 2, False, "parallel.tp_plan")
    with pytest.raises(ConfigError, match="one of"):
        check_tp_plan(gpt, {"blocks.*.attn.q": "diagonal"}, 2, False, "parallel.tp_plan")
    with pytest.raises(ConfigError, match="no sequence_split entry"):
        check_tp_plan(gpt, {"blocks.*.attn.q": "colwise"}, 2, True, "parallel.tp_plan")
    with pytest.raises(ConfigError, match="only on nn.Linear or nn.Embedding"):
        check_tp_plan(CNN(3, 10, [8, 16]), {"blocks.0.conv1": "colwise"}, 2, False, "parallel.tp_plan")
