"""Checkpoint files never run code: a crafted index, metadata or stored item is refused, not executed."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from disttrain.checkpoint.export import consolidated_weights
from disttrain.checkpoint.io import (
    CheckpointReadError,
    check_checkpoint,
    load_metadata,
    load_sharded,
    load_weights_file,
)


class Payload:
    """Unpickling this calls ``Path.touch`` on the marker: the sign that a file ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    path = tmp_path / "last.ckpt"
    dcp.save({"state_dict": {"w": torch.arange(4.0)}, "hyper": {"lr": 0.1, "betas": (0.9, 0.95)}},
             checkpoint_id=str(path), no_dist=True)
    torch.save({"global_step": 3}, path / "meta.pt")
    return path


def test_a_genuine_checkpoint_loads(checkpoint):
    assert load_metadata(checkpoint) == {"global_step": 3}
    state = {"state_dict": {"w": torch.zeros(4)}, "hyper": {"lr": 0.0, "betas": (0.0, 0.0)}}
    load_sharded(state, checkpoint)
    assert torch.equal(state["state_dict"]["w"], torch.arange(4.0)) and state["hyper"]["lr"] == 0.1
    assert torch.equal(consolidated_weights(checkpoint)["w"], torch.arange(4.0))


def test_crafted_files_are_refused_without_running(checkpoint, tmp_path):
    marker = tmp_path / "ran"
    torch.save({"global_step": Payload(marker)}, checkpoint / "meta.pt")
    with pytest.raises(CheckpointReadError, match=r"last.ckpt cannot be read: its meta.pt is not plain data \("):
        load_metadata(checkpoint)
    with pytest.raises(CheckpointReadError, match="its meta.pt is not plain data"):
        check_checkpoint(checkpoint)
    index = checkpoint / ".metadata"
    genuine = index.read_bytes()
    index.write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(CheckpointReadError, match="refers to pathlib.Path.touch, which a torch.distributed.checkpoint"):
        load_sharded({"state_dict": {"w": torch.zeros(4)}}, checkpoint)
    with pytest.raises(CheckpointReadError, match="refers to pathlib.Path.touch"):
        consolidated_weights(checkpoint)
    assert not marker.exists()
    index.write_bytes(genuine)


def test_a_stored_object_is_refused_by_every_reader(tmp_path):
    # an item of the model's own state that would run code: consolidation (export, generation) and the check of a
    # resumed checkpoint load it as plain data, and refuse it naming the item and its shard
    marker = tmp_path / "ran"
    path = tmp_path / "crafted.ckpt"
    dcp.save({"state_dict": {"w": torch.arange(4.0), "extra": Payload(marker)}}, checkpoint_id=str(path),
             no_dist=True)
    torch.save({"global_step": 3}, path / "meta.pt")
    refusal = r"crafted.ckpt cannot be read: its item state_dict.extra \(in __0_0.distcp\) is not plain data \("
    with pytest.raises(CheckpointReadError, match=refusal):
        consolidated_weights(path)
    with pytest.raises(CheckpointReadError, match=refusal):
        check_checkpoint(path)
    assert not marker.exists()


def test_a_damaged_checkpoint_is_one_line_naming_the_file(checkpoint):
    check_checkpoint(checkpoint)  # the genuine one passes
    shard = checkpoint / "__0_0.distcp"
    whole = shard.read_bytes()
    shard.write_bytes(whole[:10])
    for read in (check_checkpoint, consolidated_weights):
        with pytest.raises(CheckpointReadError, match=f"its shard __0_0.distcp holds 10 bytes, its index needs "
                                                      f"{len(whole)}"):
            read(checkpoint)
    shard.write_bytes(whole)
    (checkpoint / ".metadata").write_bytes(b"garbage")
    with pytest.raises(CheckpointReadError, match="its index .metadata is not a torch.distributed.checkpoint index"):
        consolidated_weights(checkpoint)
    (checkpoint / "meta.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointReadError, match="its meta.pt is not a torch file of plain data") as caught:
        check_checkpoint(checkpoint)
    assert "\n" not in str(caught.value)
    assert str(pickle.loads(pickle.dumps(caught.value))) == str(caught.value)  # it crosses from a rank to the job
    (checkpoint / "meta.pt").unlink()
    with pytest.raises(CheckpointReadError, match="its meta.pt is missing"):
        check_checkpoint(checkpoint)


def test_a_weights_file_loads_as_plain_data_only(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"w": torch.arange(3.0)}, tmp_path / "model.pt")
    assert torch.equal(load_weights_file(tmp_path / "model.pt")["w"], torch.arange(3.0))
    torch.save({"w": Payload(marker)}, tmp_path / "crafted.pt")
    with pytest.raises(CheckpointReadError, match="crafted.pt cannot be read: it is not plain data"):
        load_weights_file(tmp_path / "crafted.pt")
    assert not marker.exists()


def test_a_stored_object_is_refused_where_torch_would_run_it(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "crafted.ckpt"
    dcp.save({"hyper": Payload(marker)}, checkpoint_id=str(path), no_dist=True)
    with pytest.raises(CheckpointReadError, match=r"its item hyper \(in __0_0.distcp\) is not plain data"):
        load_sharded({"hyper": None}, path)
    assert not marker.exists()
    # the control: torch's own loader runs it (so the payload above is live, and the refusal is the reader's)
    dcp.load({"hyper": None}, checkpoint_id=str(path), no_dist=True)
    assert marker.exists()


class OneRank:
    """The strategy of a one-process run, as the checkpoints see it."""

    is_global_zero, global_rank, world_size = True, 0, 1

    def barrier(self, name: str | None = None) -> None:
        """Nobody to wait for."""

    def broadcast(self, obj, src: int = 0):
        """Rank 0's object is this one."""
        return obj


COLLECTIVES = ("gather_object", "scatter_object_list", "broadcast_object_list", "all_gather_object", "gather",
               "scatter", "broadcast", "all_gather", "all_reduce", "reduce", "barrier")


@pytest.mark.parametrize("async_save", [False, True])
def test_a_one_process_checkpoint_is_saved_and_loaded_without_collectives(tmp_path, monkeypatch, async_save):
    # torch.distributed.checkpoint plans through a one-rank group too, on gloo's own threads, whose copies start
    # OpenMP thread teams of their own: with 2 torch threads every later step of the CNN ran 1.7x slower
    import torch.distributed as dist

    from disttrain.checkpoint.sharded import ShardedCheckpoints

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        called = []
        for name in COLLECTIVES:  # each still runs, and is noted
            real = getattr(dist, name)
            monkeypatch.setattr(dist, name, lambda *args, name=name, real=real, **kwargs: (
                called.append(name), real(*args, **kwargs))[1])
        weights = torch.randn(300, 300)  # a plan and tensors above torch's grain for parallel copies
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            checkpoints = ShardedCheckpoints(OneRank(), async_save=async_save)
            checkpoints.save({"state_dict": {"w": weights}, "optimizer_states": [{"step": torch.tensor(3.0)}]},
                             tmp_path / "last.ckpt")
            checkpoints.wait()
            state = {"state_dict": {"w": torch.zeros(300, 300)}}
            load_sharded(state, tmp_path / "last.ckpt")
        assert torch.equal(state["state_dict"]["w"], weights)
        assert called == []
        # torch's notice that it assumes a single process, which disttrain chose: not printed on every run
        assert not [w for w in caught if "single process" in str(w.message)]
    finally:
        monkeypatch.undo()
        if own_group:
            dist.destroy_process_group()


def test_replicas_kept_apart_consolidate_to_the_first(tmp_path):
    # Local SGD, DiLoCo and an asynchronous parameter server save each replica's state under replica<i>
    path = tmp_path / "replicas.ckpt"
    dcp.save({f"replica{i}": {"state_dict": {"net.w": torch.full((3,), float(i))}, "hyper": {"lr": 0.1 * i}}
              for i in range(2)}, checkpoint_id=str(path), no_dist=True)
    weights = consolidated_weights(path)
    assert list(weights) == ["w"] and torch.equal(weights["w"], torch.zeros(3))


def test_a_later_run_in_this_process_writes_its_own_dtypes_where_the_shapes_are_the_same(tmp_path):
    """A sweep's jobs run in one process: the second job's checkpoint, of the same shapes in another dtype, holds
    its own metadata, not a save plan cached by the first (torch compares a cached plan by shapes alone)."""
    import gc

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.planner import SavePlanner

    from disttrain.checkpoint.sharded import ShardedCheckpoints

    dtypes = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        weights = torch.randn(64, 64).to(dtype)
        checkpoints = ShardedCheckpoints(OneRank())
        for step in range(2):  # the second save of a run takes its own cached plan
            checkpoints.save({"state_dict": {"w": weights}, "optimizer_states": []}, tmp_path / f"{name}{step}.ckpt")
        metadata = FileSystemReader(str(tmp_path / f"{name}1.ckpt")).read_metadata()
        dtypes[name] = metadata.state_dict_metadata["state_dict.w"].properties.dtype
        state = {"state_dict": {"w": torch.zeros(64, 64, dtype=dtype)}}
        load_sharded(state, tmp_path / f"{name}1.ckpt")
        assert torch.equal(state["state_dict"]["w"], weights)
        key = checkpoints._plan_key
        assert key in SavePlanner._cached_metadata
        del checkpoints  # a finished run's plans are dropped with its checkpoints: a sweep's do not pile up
        gc.collect()
        assert key not in SavePlanner._cached_metadata
    assert dtypes == {"fp32": torch.float32, "bf16": torch.bfloat16}
