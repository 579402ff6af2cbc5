"""apply_parallelism's DDP path: accumulation micro-batches do not communicate; the syncing one does. The
strategy accumulates as ``parallel.accumulate_grads`` says."""

from __future__ import annotations

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from disttrain.parallel.apply import apply_parallelism, backward_sync_disabled
from disttrain.parallel.config import ParallelConfig
from disttrain.parallel.dims import MESH_DIM_NAMES, ParallelDims
from disttrain.parallel.layout import Layout
from tests.dist_utils import run_on_ranks


def count_ddp_communication() -> tuple[int, int]:
    torch.manual_seed(0)
    dims = ParallelDims(pp=1, dp_replicate=2, dp_shard=1, tp=1)
    mesh = init_device_mesh("cpu", dims.mesh_shape, mesh_dim_names=MESH_DIM_NAMES)
    model = apply_parallelism(nn.Linear(8, 8), mesh, Layout.of(ParallelConfig(name="ddp", dp_replicate=2), dims),
                              torch.device("cpu"))
    calls = []

    def counting_hook(state, bucket):
        calls.append(1)
        work = dist.all_reduce(bucket.buffer(), async_op=True, group=mesh["dp_replicate"].get_group())
        return work.get_future().then(lambda fut: fut.value()[0] / 2)

    model.register_comm_hook(None, counting_hook)
    with backward_sync_disabled(model):
        model(torch.randn(4, 8)).sum().backward()
    accumulating = len(calls)
    model(torch.randn(4, 8)).sum().backward()
    return accumulating, len(calls)


def test_accumulation_skips_the_all_reduce():
    for accumulating, total in run_on_ranks(count_ddp_communication, 2):
        assert accumulating == 0 and total >= 1


@pytest.mark.parametrize(("zero_stage", "mode", "sharded"),
                         [(3, "auto", True), (2, "sharded", True), (3, "unsharded", False), (1, "auto", False)])
def test_the_strategy_accumulates_as_the_config_says(monkeypatch, zero_stage, mode, sharded):
    import disttrain.parallel.strategy as strategy

    seen = []

    @contextmanager
    def recording(model, sharded_accumulation):
        seen.append((model, sharded_accumulation))
        yield

    monkeypatch.setattr(strategy, "backward_sync_disabled", recording)
    layout = Layout.of(ParallelConfig(zero_stage=zero_stage, accumulate_grads=mode), ParallelDims())
    owner = SimpleNamespace(layout=layout, lightning_module=SimpleNamespace(net="the net"))
    with strategy.DistTrainStrategy.block_backward_sync(owner):
        pass
    assert seen == [("the net", sharded)]
