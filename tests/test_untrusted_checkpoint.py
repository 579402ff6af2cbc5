"""A crafted checkpoint of a real run runs no code anywhere it is read: its index holds only the classes an index
holds, and one stored object whose pickle would run a shell command. Export (pt and hf), generation and resuming
refuse it in one line with exit status 2; so they do a damaged or missing checkpoint."""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from disttrain.checkpoint.io import load_index
from disttrain.config import validate
from disttrain.errors import ConfigError
from tests.conftest import ROOT, compose_config

RUN = ["model=llama", "model.flavour=micro", "model.n_layer=2", "model.n_embd=64", "model.n_head=4",
       "model.n_kv_head=2", "data=pydocs", "data.block_size=32", "batch.global_size=8", "trainer.max_steps=2",
       "trainer.limit_val_batches=1", "trainer.run_test=false", "logger=csv", "callbacks=none"]
"""Two steps of a micro llama on Python's docs: a model that exports to pt and hf and generates text."""
SHARD = "__0_0.distcp"


class ShellCommand:
    """Unpickling this runs ``touch MARKER`` in a shell: the sign that a file ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    from disttrain.launch.job import train

    path = tmp_path_factory.mktemp("run")
    train(compose_config(RUN, path))
    return path


def crafted(run_dir: Path, where: Path) -> tuple[Path, Path]:
    """A copy of ``run_dir`` whose last checkpoint holds one more item of the model's state, ``state_dict.net.evil``:
    a stored object appended to its shard and declared in its index with the index's own classes only. Returns the
    copy and the marker file its pickle would create."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    copy, marker = where / "crafted", where / "ran"
    shutil.copytree(run_dir, copy)
    checkpoint = copy / "checkpoints" / "last.ckpt"
    buffer = io.BytesIO()
    torch.save(ShellCommand(marker), buffer)
    shard = checkpoint / SHARD
    offset = shard.stat().st_size
    with shard.open("ab") as handle:
        handle.write(buffer.getvalue())
    index = load_index(checkpoint)
    key = "state_dict.net.evil"
    index.state_dict_metadata[key] = BytesStorageMetadata()
    index.planner_data[key] = ("state_dict", "net.evil")
    index.storage_data[MetadataIndex(key)] = _StorageInfo(SHARD, offset, len(buffer.getvalue()))
    (checkpoint / ".metadata").write_bytes(pickle.dumps(index))
    load_index(checkpoint)  # the allow-list takes the index itself
    return copy, marker


def exit_of(main, argv: list[str], capsys) -> tuple[int, list[str]]:
    """A command's entry point called in this process with ``argv``: its exit status and its stderr's lines."""
    try:
        with mock.patch.object(sys, "argv", ["command", *argv]):
            main()
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 1
    return code, capsys.readouterr().err.strip().splitlines()


REFUSAL = (r"^Error: .*/crafted/checkpoints/last.ckpt cannot be read: its item state_dict.net.evil \(in __0_0.distcp\) "
           r"is not plain data \(Trying to load unsupported GLOBAL posix.system .*\); refusing to load it$")


def test_torchs_own_consolidation_runs_the_crafted_item(run_dir, tmp_path):
    # the control: what export used (torch's empty-state planner, which loads stored objects with
    # weights_only=False) runs the command, so the refusals below are the reader's and the payload is live
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    copy, marker = crafted(run_dir, tmp_path)
    _load_state_dict_from_keys(keys={"state_dict"}, checkpoint_id=str(copy / "checkpoints" / "last.ckpt"))
    assert marker.exists()


@pytest.mark.parametrize("form", ["pt", "hf"])
def test_export_refuses_the_crafted_item_without_running_it(run_dir, tmp_path, capsys, form):
    from disttrain.checkpoint.export import main

    copy, marker = crafted(run_dir, tmp_path)
    source = copy / "checkpoints" / "last.ckpt" if form == "pt" else copy
    code, lines = exit_of(main, [str(source), str(tmp_path / "out"), "--format", form], capsys)
    assert code == 2 and len(lines) == 1
    assert re.match(REFUSAL, lines[0]), lines
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_generation_refuses_the_crafted_item_without_running_it(run_dir, tmp_path, capsys):
    from disttrain.generate.__main__ import main

    copy, marker = crafted(run_dir, tmp_path)
    code, lines = exit_of(main, [str(copy), "--prompt", "def ", "--checkpoint", "last"], capsys)
    assert code == 2 and len(lines) == 1
    assert re.match(REFUSAL, lines[0]), lines
    assert not marker.exists()


def damage(checkpoint: Path, kind: str, marker: Path) -> str:
    """Damage ``checkpoint`` in one way; the words of its refusal."""
    if kind == "crafted meta.pt":
        torch.save({"global_step": ShellCommand(marker)}, checkpoint / "meta.pt")
        return "its meta.pt is not plain data (Trying to load unsupported GLOBAL posix.system"
    if kind == "garbage meta.pt":
        (checkpoint / "meta.pt").write_bytes(b"garbage")
        return "its meta.pt is not a torch file of plain data"
    if kind == "crafted index":
        (checkpoint / ".metadata").write_bytes(pickle.dumps(ShellCommand(marker)))
        return "its index .metadata refers to posix.system, which a torch.distributed.checkpoint index never holds"
    if kind == "garbage index":
        (checkpoint / ".metadata").write_bytes(b"garbage")
        return "its index .metadata is not a torch.distributed.checkpoint index"
    assert kind == "short shard"
    size = (checkpoint / SHARD).stat().st_size
    os.truncate(checkpoint / SHARD, 100)
    return f"its shard {SHARD} holds 100 bytes, its index needs {size}"


READ_BY_EXPORT = ["crafted index", "garbage index", "short shard"]
"""The damage that export and generation meet (they read no meta.pt)."""


@pytest.mark.parametrize("kind", READ_BY_EXPORT)
def test_a_damaged_checkpoint_is_one_line_from_export_and_generation(run_dir, tmp_path, capsys, kind):
    from disttrain.checkpoint.export import main as export_main
    from disttrain.generate.__main__ import main as generate_main

    copy, marker = tmp_path / "run", tmp_path / "ran"
    shutil.copytree(run_dir, copy)
    checkpoint = copy / "checkpoints" / "last.ckpt"
    words = damage(checkpoint, kind, marker)
    for main in (export_main, generate_main):
        argv = [str(checkpoint), str(tmp_path / "out.pt")] if main is export_main else [str(copy), "--prompt", "d"]
        code, lines = exit_of(main, argv, capsys)
        assert code == 2 and len(lines) == 1 and lines[0].startswith(f"Error: {checkpoint} cannot be read: {words}")
    assert not marker.exists()


def test_export_of_a_missing_checkpoint_is_one_line(tmp_path, capsys):
    from disttrain.checkpoint.export import main

    code, lines = exit_of(main, [str(tmp_path / "nowhere"), str(tmp_path / "out.pt")], capsys)
    assert code == 2 and lines == [f"Error: {tmp_path / 'nowhere'} is not a sharded checkpoint folder (no .metadata "
                                   "inside)"]


@pytest.mark.parametrize("kind", ["crafted meta.pt", "garbage meta.pt", *READ_BY_EXPORT, "crafted item"])
def test_resume_from_a_damaged_checkpoint_is_refused_by_validation(run_dir, tmp_path, kind):
    # in the job's validation, before any rank starts: one ConfigError naming resume, the folder and the file
    if kind == "crafted item":
        copy, marker = crafted(run_dir, tmp_path)
        words = "its item state_dict.net.evil (in __0_0.distcp) is not plain data"
    else:
        copy, marker = tmp_path / "run", tmp_path / "ran"
        shutil.copytree(run_dir, copy)
        words = damage(copy / "checkpoints" / "last.ckpt", kind, marker)
    checkpoint = copy / "checkpoints" / "last.ckpt"
    with pytest.raises(ConfigError) as refused:
        validate(compose_config([*RUN, f"resume={checkpoint}"], tmp_path / "resumed"))
    assert str(refused.value).startswith(f"resume='{checkpoint}' is invalid: a checkpoint folder that can be read; "
                                         f"{words}")
    assert "\n" not in str(refused.value) and not marker.exists()


def test_resume_from_a_crafted_checkpoint_is_one_line_and_exit_2(run_dir, tmp_path):
    # as a user runs it: nothing trains, no rank starts, one line
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    damage(copy / "checkpoints" / "last.ckpt", "crafted meta.pt", tmp_path / "ran")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(ROOT / "train.py"), *RUN, f"run_dir={tmp_path / 'resumed'}",
                           f"resume={copy}"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"Error: resume='{copy / 'checkpoints' / 'last.ckpt'}' is "
                                                   "invalid: a checkpoint folder that can be read; its meta.pt is not "
                                                   "plain data"), lines
    assert not (tmp_path / "ran").exists() and not (tmp_path / "resumed" / "checkpoints").exists()


def test_a_preempted_jobs_step_is_unknown_where_its_checkpoint_is_crafted(run_dir, tmp_path):
    # the supervisor names the step the ranks saved as they stopped: a crafted meta.pt leaves it unnamed
    from disttrain.launch.restart_all import RestartAll

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    supervisor = object.__new__(RestartAll)  # only its run's config path is read
    supervisor.config_path = copy / "config.yaml"
    assert supervisor._saved_step() == 2
    damage(copy / "checkpoints" / "last.ckpt", "crafted meta.pt", tmp_path / "ran")
    assert supervisor._saved_step() is None and not (tmp_path / "ran").exists()
