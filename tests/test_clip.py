"""Global-norm clipping of sharded gradients equals ``torch.nn.utils.clip_grad_norm_`` on the whole model.

Every rank runs the same micro GPT on the same batch, so every layout's gradients are those of one process.
For each layout (FSDP2 over 4 ranks, hybrid sharding 2 x 2, tensor parallelism, FSDP2 x TP with
``_StridedShard`` placements, pipeline stages with and without FSDP2 inside each stage) the returned norm
and the clipped gradients, gathered to whole tensors, are compared with torch's clipping of the unsharded
model. The clip binds (the norm is far above ``MAX_NORM``), so a wrong norm changes every gradient.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from disttrain.models.gpt import GPT, GPTDims
from disttrain.parallel.clip import clip_grad_norm
from disttrain.parallel.fsdp import apply_fsdp
from disttrain.parallel.model_plan import pipeline_units_of
from disttrain.parallel.pipeline.split import build_stage_module, unit_split_points
from disttrain.parallel.tp import apply_tp
from tests.dist_utils import run_on_ranks

DIMS = GPTDims(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)
MAX_NORM = 0.05
# measured: norms agree to 2e-7 relative, clipped gradients to 1e-8 absolute (fp32 reduction order)
NORM_RTOL, GRAD_RTOL, GRAD_ATOL = 1e-6, 1e-5, 1e-7


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(DIMS, dropout=0.0, tie_weights=False)


def _backward(model: nn.Module) -> None:
    tokens = torch.randint(0, DIMS.vocab_size, (8, DIMS.block_size + 1), generator=torch.Generator().manual_seed(1))
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.reshape(-1, DIMS.vocab_size), tokens[:, 1:].reshape(-1)).backward()


def _whole_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone().numpy()
            for name, p in model.named_parameters()}


def _clip(model: nn.Module, across: dist.ProcessGroup | None = None) -> dict:
    _backward(model)
    norm = clip_grad_norm(list(model.parameters()), MAX_NORM, across=across)
    return {"norm": norm.item(), "grads": _whole_grads(model)}


def _layouts_worker() -> dict:
    out = {}
    mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("dp_shard",))
    out["fsdp"] = _clip(apply_fsdp(_model(), mesh, reshard_after_forward=True))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    out["hsdp"] = _clip(apply_fsdp(_model(), mesh, reshard_after_forward=True))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    out["tp"] = _clip(apply_tp(_model(), mesh["tp"], _model().tp_plan()))
    out["tp+sp"] = _clip(apply_tp(_model(), mesh["tp"], _model().tp_plan(), sequence_parallel=True))
    model = apply_tp(_model(), mesh["tp"], _model().tp_plan())
    out["fsdp x tp"] = _clip(apply_fsdp(model, mesh["dp_shard"], reshard_after_forward=True))
    # pipeline: each pp rank clips the parameters of its own stage (a slice of the model), across the pp group
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
    for name, shard in (("pipeline", False), ("pipeline x fsdp", True)):
        model = _model()
        _backward(model)
        pp_rank = mesh.get_local_rank("pp")
        units = pipeline_units_of(model)
        stage = build_stage_module(model, units, pp_rank, unit_split_points(model, units, 2))
        params = list(stage.parameters())
        if shard:  # shard the stage and hand it the whole-model gradients as sharded DTensors
            grads = [p.grad for p in params]
            fully_shard(stage, mesh=mesh["dp_shard"])
            params = list(stage.parameters())
            for p, full in zip(params, grads, strict=True):
                p.grad = distribute_tensor(full, p.device_mesh, p.placements)
        norm = clip_grad_norm(params, MAX_NORM, across=mesh["pp"].get_group())
        out[name] = {"norm": norm.item(), "grads": _whole_grads(stage)}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_on_ranks(_layouts_worker, 4)


@pytest.fixture(scope="module")
def reference() -> dict:
    model = _model()
    _backward(model)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    assert norm > 10 * MAX_NORM  # the clip binds
    return {"norm": norm.item(), "grads": {n: p.grad.detach().clone() for n, p in model.named_parameters()}}


@pytest.mark.parametrize("layout", ["fsdp", "hsdp", "tp", "tp+sp", "fsdp x tp", "pipeline", "pipeline x fsdp"])
def test_clip_matches_torch_on_the_unsharded_model(results, reference, layout):
    for rank, result in enumerate(results):
        got = result[layout]
        assert got["norm"] == pytest.approx(reference["norm"], rel=NORM_RTOL), (rank, layout)
        assert set(got["grads"]) <= set(reference["grads"]) and got["grads"], (rank, layout)
        for name, grad in got["grads"].items():
            torch.testing.assert_close(torch.from_numpy(grad), reference["grads"][name], rtol=GRAD_RTOL,
                                       atol=GRAD_ATOL, msg=f"rank {rank} {layout} {name}")
