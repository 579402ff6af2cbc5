"""``python -m disttrain.checkpoint.export --format safetensors``: the tensors and names of ``--format pt`` in one
safetensors file, written whole or not at all, with tied or shared tensors written apart (safetensors refuses
shared memory). The round trip through a run's ``model.init_weights`` is in ``tests/test_init_weights.py``."""

from __future__ import annotations

import sys
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load, load_file, save, save_file

from disttrain.checkpoint.atomic import new_file_mode, write_atomically
from disttrain.checkpoint.export import main, safetensors_tensors
from disttrain.checkpoint.io import load_weights_file


def export_status(*args: str | Path) -> int:
    """``python -m disttrain.checkpoint.export *args``'s entry point, called in this process: its exit status."""
    with mock.patch.object(sys, "argv", ["export", *map(str, args)]):
        try:
            main()
        except SystemExit as stop:
            return stop.code if isinstance(stop.code, int) else 1
    return 0


def saved_checkpoint(path: Path, state: dict) -> Path:
    """A one-process checkpoint folder holding ``state`` as a run's model state (``state_dict.net.*``)."""
    dcp.save({"state_dict": {f"net.{name}": value for name, value in state.items()}}, checkpoint_id=str(path),
             no_dist=True)
    return path


def test_safetensors_holds_the_tensors_and_names_of_pt(tmp_path):
    torch.manual_seed(0)
    state = {"embed.weight": torch.randn(8, 4), "head.weight": torch.randn(8, 4),
             "norm.weight": torch.randn(4).to(torch.bfloat16), "steps": torch.tensor(3)}
    checkpoint = saved_checkpoint(tmp_path / "last.ckpt", state)
    assert export_status(checkpoint, tmp_path / "model.pt") == 0
    assert export_status(checkpoint, "--format", "safetensors", tmp_path / "model.safetensors") == 0
    as_pt, as_safetensors = load_weights_file(tmp_path / "model.pt"), load_file(tmp_path / "model.safetensors")
    assert sorted(as_safetensors) == sorted(as_pt) == sorted(state)
    for name, tensor in state.items():
        assert as_safetensors[name].dtype == tensor.dtype and torch.equal(as_safetensors[name], tensor), name
    assert (tmp_path / "model.safetensors").stat().st_mode & 0o777 == new_file_mode()  # not safetensors' 0o600
    assert sorted(path.name for path in tmp_path.iterdir()) == ["last.ckpt", "model.pt", "model.safetensors"]


def test_tied_and_shared_tensors_are_written_apart():
    """A weight tied to another (one tensor under two names) and views of one buffer share memory, which
    safetensors refuses: each is written under its own name with its own values, as the model held them. (The
    checkpoint reader gives every item its own memory today; the writer does not rely on it.)"""
    embed = torch.randn(8, 4)
    fused = torch.randn(3, 4, 4)
    weights = {"embed.weight": embed, "head.weight": embed, "q.weight": fused[0], "k.weight": fused[1],
               "v.weight": fused[2].t()}
    read_back = load(save(safetensors_tensors(weights)))
    assert sorted(read_back) == sorted(weights)
    for name, tensor in weights.items():
        assert torch.equal(read_back[name], tensor), name


def test_a_value_that_is_no_tensor_is_refused_in_one_line(tmp_path, capsys):
    dcp.save({"state_dict": {"net.w": torch.zeros(2), "net.note": {"made_by": "a hook"}}},
             checkpoint_id=str(tmp_path / "last.ckpt"), no_dist=True)
    assert export_status(tmp_path / "last.ckpt", "--format", "safetensors", tmp_path / "w.safetensors") == 2
    error = capsys.readouterr().err
    assert error == ("Error: --format='safetensors' is invalid: pt for this checkpoint: its model state holds "
                     "note.made_by as str, and a safetensors file holds tensors only\n")
    assert not any(path.name.startswith("w.safetensors") for path in tmp_path.iterdir())


def test_a_write_that_fails_leaves_the_file_that_was_there(tmp_path):
    output = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(2)}, str(output))

    def crash(staging: Path) -> None:
        staging.write_bytes(b"half a file")
        raise OSError("No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomically(output, crash)
    assert torch.equal(load_file(output)["w"], torch.ones(2))
    assert [path.name for path in tmp_path.iterdir()] == ["model.safetensors"]


def test_a_lora_checkpoint_without_its_runs_config_is_refused_in_one_line_unless_kept_as_held(tmp_path, capsys):
    """Merging a LoRA checkpoint's adapters needs the model its run's ``config.yaml`` describes: a checkpoint
    folder without one is refused in one line that names it and ``--keep-adapters``, which writes it as held."""
    state = {"attn.q.base_layer.weight": torch.ones(2, 2), "attn.q.lora_A.default.weight": torch.ones(1, 2)}
    checkpoint = saved_checkpoint(tmp_path / "copied" / "last.ckpt", state)
    assert export_status(checkpoint, "--format", "safetensors", tmp_path / "merged.safetensors") == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"Error: no config.yaml in {tmp_path}, the run directory of {checkpoint}: a LoRA checkpoint's "
                   "adapters are merged on the model the run's config describes (--keep-adapters writes them "
                   "unmerged)"), err
    assert not (tmp_path / "merged.safetensors").exists()
    assert export_status(checkpoint, "--format", "safetensors", "--keep-adapters", tmp_path / "held.safetensors") == 0
    assert load_file(tmp_path / "held.safetensors").keys() == state.keys()
