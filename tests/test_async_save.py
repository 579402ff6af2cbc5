"""``checkpoint.async_save=true`` writes the same files as a synchronous save, and a run resumes from them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from disttrain.checkpoint.io import load_index, load_metadata
from tests.fault_runs import assert_same_weights, logged_losses, run


@pytest.mark.parametrize("preset", ["ddp", "zero3"])
def test_async_save_writes_the_files_of_a_sync_save(tmp_path, preset):
    dirs = {}
    for mode in ("false", "true"):
        dirs[mode] = tmp_path / f"async-{mode}"
        done = run([f"parallel={preset}", f"checkpoint.async_save={mode}", "checkpoint.keep_last=3"], dirs[mode])
        assert done.returncode == 0, done.stderr[-3000:]
    for name in ("last.ckpt", "last-step8.ckpt", "last-step4.ckpt"):
        sync, background = dirs["false"] / "checkpoints" / name, dirs["true"] / "checkpoints" / name
        shards = sorted(p.name for p in sync.glob("*.distcp"))
        assert shards and shards == sorted(p.name for p in background.glob("*.distcp"))
        for shard in shards:
            assert (sync / shard).read_bytes() == (background / shard).read_bytes(), (name, shard)
        # the index differs only in its storage_meta: the folder it was written to and a random save id
        index, other = load_index(sync), load_index(background)
        assert (index.state_dict_metadata, index.storage_data, index.planner_data) == (
            other.state_dict_metadata, other.storage_data, other.planner_data)
        # meta.pt differs only in the wall-clock fields of the throughput meter
        ours, theirs = load_metadata(sync), load_metadata(background)
        for meta in (ours, theirs):
            meta["callbacks"].pop("ThroughputMeter")
        assert torch.equal(ours["callbacks"]["RandomStates"]["ranks"][1]["torch"],
                           theirs["callbacks"]["RandomStates"]["ranks"][1]["torch"])
        assert ours["global_step"] == theirs["global_step"]
    assert logged_losses(dirs["true"]) == logged_losses(dirs["false"])
    assert_same_weights(dirs["true"], dirs["false"])
    assert not list(Path(dirs["true"] / "checkpoints").glob("*.partial"))
