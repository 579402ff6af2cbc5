"""ZeRO-1/2/3, HSDP and activation checkpointing: plain training loops on gloo ranks equal one process.

A micro GPT (tied LM head) trains 20 steps on 4 fixed random token batches that cycle; the global batch
of 8 sequences is split over the data-parallel ranks and the per-step loss averaged over them. Two
spawned runs do all the distributed work: 4 ranks (HSDP 2x2; ZeRO-1 with a checkpoint written), then
2 ranks (ZeRO-1/2/3 with AdamW, LAMB and LARS; the wrong shard-local LAMB norms; activation
checkpointing under ZeRO-3; accumulation without gradient sync; a model without ``blocks``; ZeRO-1
resumed from the 4-rank checkpoint). The references run in the test process.
"""

from __future__ import annotations

import functools
import math
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from disttrain.checkpoint.io import load_sharded
from disttrain.models.cnn import CNN
from disttrain.models.gpt import GPT, GPTDims
from disttrain.optim import Lamb, Lars, param_groups
from disttrain.parallel.activation_checkpoint import apply_activation_checkpointing, is_checkpointed
from disttrain.parallel.dims import MESH_DIM_NAMES, ParallelDims
from disttrain.parallel.fsdp import apply_fsdp, mixed_precision_policy, set_gradient_sync
from disttrain.parallel.model_plan import shard_units_of
from disttrain.parallel.zero1 import (
    load_zero1_state_dict,
    shard_optimizer_state,
    zero1_load_template,
    zero1_state_dict,
)
from tests.dist_utils import run_on_ranks

DIMS = GPTDims(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
STEPS, BATCH, RESUME_AT = 20, 8, 5
OPTIMIZERS = ("adamw", "lamb", "lars")
RTOL, ATOL = 1.3e-6, 1e-5


def make_gpt(dropout: float = 0.0) -> GPT:
    torch.manual_seed(0)
    return GPT(DIMS, dropout=dropout)


class Tower(nn.Module):
    """A user model with no ``blocks``: one large child, a small one and a tied embedding / head pair."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(DIMS.vocab_size, 32)
        self.body = nn.Sequential(nn.Linear(32, 256), nn.GELU(), nn.Linear(256, 32))
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, DIMS.vocab_size, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.body(self.embed(idx))))


def make_optimizer(name: str, model: nn.Module, shard_local_norms: bool = False) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)
    if name == "lamb":
        return Lamb(param_groups(model, 0.1, adapt=True), lr=0.02, weight_decay=0.1,
                    shard_local_norms=shard_local_norms)
    return Lars(param_groups(model, 0.01, adapt=True), lr=0.5, eta=0.02, weight_decay=0.01,
                shard_local_norms=shard_local_norms)


def batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    fixed = [torch.randint(0, DIMS.vocab_size, (BATCH, DIMS.block_size + 1), generator=gen) for _ in range(4)]
    return [fixed[i % 4] for i in range(STEPS)]


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: range = range(STEPS), accumulate: int = 1) -> list:
    """Global-batch loss per step; with ``accumulate`` micro-batches, only the last syncs gradients."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    data, losses = batches(), []
    for step in steps:
        rows = data[step][rank * BATCH // world:(rank + 1) * BATCH // world]
        opt.zero_grad()
        total = torch.zeros(())
        for i, micro in enumerate(rows.chunk(accumulate)):
            set_gradient_sync(model, i == accumulate - 1)
            logits = model(micro[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, DIMS.vocab_size), micro[:, 1:].reshape(-1))
            (loss / accumulate).backward()
            total += loss.detach() / accumulate
        opt.step()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


# ------------------------------------------------------------------------------------------------------
# What the ranks run
# ------------------------------------------------------------------------------------------------------


def _fsdp_run(dp_mesh, name: str, reshard: bool, shard_local_norms: bool = False, checkpointing: bool = False,
              accumulate: int = 1) -> dict:
    model = make_gpt()
    if checkpointing:
        apply_activation_checkpointing(model)
    apply_fsdp(model, dp_mesh, reshard_after_forward=reshard)
    opt = make_optimizer(name, model, shard_local_norms)
    return {"losses": train(model, opt, accumulate=accumulate), "tied": model.tied,
            "units": sum(isinstance(m, FSDPModule) for m in model.modules()),
            "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
            "checkpointed": all(is_checkpointed(b) for b in model.blocks)}


def _zero1_model(ddp_group, zero_group, name: str):
    """DDP over ``ddp_group`` (None: all ranks), optimiser state sharded over ``zero_group``."""
    model = make_gpt()
    ddp = DistributedDataParallel(model, process_group=ddp_group)
    return model, ddp, shard_optimizer_state(make_optimizer(name, model), zero_group)


def _zero1_run(group, name: str) -> dict:
    model, ddp, opt = _zero1_model(group, group, name)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.optim.param_groups]
    return {"losses": train(ddp, opt), "groups": groups, "owned": len(opt.optim.state),
            "class": type(opt.optim).__name__}


def _four_rank_worker(ckpt: str) -> dict:
    mesh = init_device_mesh("cpu", ParallelDims(dp_replicate=2, dp_shard=2).mesh_shape, mesh_dim_names=MESH_DIM_NAMES)
    out = {f"hsdp/{name}": _fsdp_run(mesh["dp_replicate", "dp_shard"], name, reshard=True) for name in OPTIMIZERS}
    # ZeRO-1 over the 4 dp ranks' gradients (DDP) with optimiser state sharded over dp_shard only; after
    # RESUME_AT steps model and optimiser are saved with torch.distributed.checkpoint.
    model, ddp, opt = _zero1_model(None, mesh["dp_shard"].get_group(), "lamb")
    losses = train(ddp, opt, range(RESUME_AT))
    dcp.save({"model": model.state_dict(), "optimizer": zero1_state_dict(opt)}, checkpoint_id=ckpt)
    out["zero1/save"] = {"losses": losses + train(ddp, opt, range(RESUME_AT, STEPS))}
    return out


def _two_rank_worker(ckpt: str) -> dict:
    mesh = init_device_mesh("cpu", ParallelDims(dp_shard=2).mesh_shape, mesh_dim_names=MESH_DIM_NAMES)
    shard = mesh["dp_shard"]
    out = {}
    for name in OPTIMIZERS:
        out[f"zero1/{name}"] = _zero1_run(shard.get_group(), name)
        out[f"zero2/{name}"] = _fsdp_run(shard, name, reshard=False)
        # the 2-D (dp_replicate=1, dp_shard=2) mesh is reduced to dp_shard
        out[f"zero3/{name}"] = _fsdp_run(mesh["dp_replicate", "dp_shard"], name, reshard=True)
    out["zero3/lamb/shard_local_norms"] = _fsdp_run(shard, "lamb", reshard=True, shard_local_norms=True)
    out["zero3/adamw/checkpointing"] = _fsdp_run(shard, "adamw", reshard=True, checkpointing=True)
    out["zero2/adamw/accumulate"] = _fsdp_run(shard, "adamw", reshard=False, accumulate=2)
    tower = Tower()
    apply_fsdp(tower, shard, reshard_after_forward=True, units=shard_units_of(tower, None, 1000))
    out["tower"] = {"losses": train(tower, make_optimizer("adamw", tower)),
                    "units": sorted(n for n, m in tower.named_modules() if isinstance(m, FSDPModule)),
                    "tied": tower.head.weight is tower.embed.weight}
    # ZeRO-1 on 2 ranks resumes the checkpoint written by 4 ranks (and, to show that the optimiser
    # state matters, once with the model weights only).
    for case in ("resume", "resume_model_only"):
        model, ddp, opt = _zero1_model(shard.get_group(), shard.get_group(), "lamb")
        state = {"model": model.state_dict(), "optimizer": zero1_load_template(opt)}
        load_sharded(state, Path(ckpt))
        model.load_state_dict(state["model"])
        if case == "resume":
            load_zero1_state_dict(opt, state["optimizer"])
        else:
            opt = shard_optimizer_state(make_optimizer("lamb", model), shard.get_group())
        out[f"zero1/{case}"] = {"losses": train(ddp, opt, range(RESUME_AT, STEPS))}
    return out


# ------------------------------------------------------------------------------------------------------
# Fixtures and tests
# ------------------------------------------------------------------------------------------------------


@functools.cache
def reference(name: str, model: str = "gpt") -> tuple[float, ...]:
    """Single-process losses (one thread, as the ranks use, and no oversubscription of a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net = make_gpt() if model == "gpt" else Tower()
        return tuple(train(net, make_optimizer(name, net)))
    finally:
        torch.set_num_threads(threads)


def assert_losses_close(losses: list[float], expected, what: str) -> None:
    assert len(losses) == len(expected), what
    for step, (got, want) in enumerate(zip(losses, expected, strict=True)):
        assert math.isclose(got, want, rel_tol=RTOL, abs_tol=ATOL), f"{what}: step {step}: {got} != {want}"


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("zero1_ckpt")


@pytest.fixture(scope="module")
def four_ranks(ckpt_dir) -> list[dict]:
    return run_on_ranks(_four_rank_worker, 4, str(ckpt_dir), timeout=150)


@pytest.fixture(scope="module")
def two_ranks(four_ranks, ckpt_dir) -> list[dict]:
    return run_on_ranks(_two_rank_worker, 2, str(ckpt_dir), timeout=150)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_references_really_train(name):
    losses = reference(name)
    assert losses[16] < losses[0] - 0.05  # same batch (4 cycle), 4 passes later: parity is not vacuous


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("stage", ["zero1", "zero2", "zero3"])
def test_zero_matches_single_process(two_ranks, stage, name):
    for rank, out in enumerate(two_ranks):
        assert_losses_close(out[f"{stage}/{name}"]["losses"], reference(name), f"{stage}/{name} rank {rank}")
    if stage != "zero1":
        run = two_ranks[0][f"{stage}/{name}"]
        # 2 blocks + root; the LM head still shares the (sharded) token embedding
        assert run["units"] == 3 and run["tied"] and run["all_dtensor"]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_hybrid_2x2_matches_single_process(four_ranks, name):
    for rank, out in enumerate(four_ranks):
        assert_losses_close(out[f"hsdp/{name}"]["losses"], reference(name), f"hsdp/{name} rank {rank}")
    assert four_ranks[0][f"hsdp/{name}"]["tied"]


def test_zero1_keeps_groups_and_options(two_ranks):
    for name, cls in (("adamw", "AdamW"), ("lamb", "Lamb"), ("lars", "Lars")):
        runs = [out[f"zero1/{name}"] for out in two_ranks]
        assert all(run["class"] == cls for run in runs)
        decayed, plain = runs[0]["groups"]
        assert decayed["weight_decay"] > 0 and plain["weight_decay"] == 0
        assert decayed["lr"] == plain["lr"] == make_optimizer(name, make_gpt()).defaults["lr"]
        if name != "adamw":
            assert decayed["adapt"] is True and plain["adapt"] is False and decayed["shard_local_norms"] is False
        # whole parameters are split between the ranks (GPT micro: 36 tensors, the LM head tied)
        assert sum(run["owned"] for run in runs) == 36 and all(run["owned"] for run in runs)


def test_shard_local_lamb_norms_are_caught(two_ranks):
    losses = two_ranks[0]["zero3/lamb/shard_local_norms"]["losses"]
    assert max(abs(a - b) for a, b in zip(losses, reference("lamb"), strict=True)) > 1e-4


def test_activation_checkpointing_under_zero3(two_ranks):
    run = two_ranks[0]["zero3/adamw/checkpointing"]
    assert run["checkpointed"]
    assert_losses_close(run["losses"], reference("adamw"), "zero3 + activation checkpointing")


def test_accumulation_without_gradient_sync(two_ranks):
    assert_losses_close(two_ranks[0]["zero2/adamw/accumulate"]["losses"], reference("adamw"), "accumulate 2")


def test_model_without_blocks_is_sharded_per_large_child(two_ranks):
    run = two_ranks[0]["tower"]
    assert run["units"] == ["", "body"] and run["tied"]  # tied embed/head stay in the root, norm is too small
    assert_losses_close(run["losses"], reference("adamw", "tower"), "tower")


def test_zero1_checkpoint_from_4_ranks_resumes_on_2(four_ranks, two_ranks):
    assert_losses_close(four_ranks[0]["zero1/save"]["losses"], reference("lamb"), "zero1 on 4 ranks")
    for rank, out in enumerate(two_ranks):
        assert_losses_close(out["zero1/resume"]["losses"], reference("lamb")[RESUME_AT:], f"resumed rank {rank}")
    fresh = two_ranks[0]["zero1/resume_model_only"]["losses"]
    assert max(abs(a - b) for a, b in zip(fresh, reference("lamb")[RESUME_AT:], strict=True)) > 1e-4


def test_activation_checkpointing_keeps_names_losses_and_grads():
    plain, ckpt = make_gpt(dropout=0.1), apply_activation_checkpointing(make_gpt(dropout=0.1))
    assert all(is_checkpointed(b) for b in ckpt.blocks) and not is_checkpointed(plain.blocks[0])
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in ckpt.named_parameters()]
    assert list(plain.state_dict()) == list(ckpt.state_dict()) and type(ckpt.blocks[0]) is type(plain.blocks[0])
    calls = []
    ckpt.blocks[0].attn.register_forward_hook(lambda *_: calls.append(1))
    x, losses = batches()[0], []
    for model in (plain, ckpt):
        torch.manual_seed(3)  # the same dropout masks; the recomputation replays them
        loss = nn.functional.cross_entropy(model(x[:, :-1]).reshape(-1, DIMS.vocab_size), x[:, 1:].reshape(-1))
        loss.backward()
        losses.append(loss.detach())
    assert len(calls) == 2  # forward, then the recomputation in backward
    assert torch.equal(losses[0], losses[1])
    for (name, p), q in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    assert apply_activation_checkpointing(ckpt) is ckpt  # idempotent
    copied = pickle.loads(pickle.dumps(apply_activation_checkpointing(make_gpt())))
    assert is_checkpointed(copied.blocks[1]) and copied.blocks[1].forward.module is copied.blocks[1]
    with pytest.raises(ValueError, match="no repeated blocks"):
        apply_activation_checkpointing(nn.Linear(2, 2))


def test_sharding_units_and_precision_policy():
    cnn = CNN(3, 10, [8, 16], blocks_per_stage=2)
    assert shard_units_of(cnn) == list(cnn.blocks)
    gpt = make_gpt()
    assert shard_units_of(gpt) == list(gpt.blocks)
    assert shard_units_of(gpt, ["ln_f", "blocks"]) == [gpt.ln_f, *gpt.blocks]  # config wins over the method
    tower = Tower()
    assert shard_units_of(tower, None, 1000) == [tower.body]  # embed and head are tied, norm is small
    listed = nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]), nn.Linear(2, 2))
    assert shard_units_of(listed) == list(listed[0])  # no method: the entries of a ModuleList child
    policy = mixed_precision_policy("bf16-mixed", "cuda")
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert mixed_precision_policy("bf16-mixed", "cpu") is None and mixed_precision_policy("32-true", "cuda") is None
