"""The private names of Lightning that disttrain still reads or sets exist in the installed Lightning, with the
meaning it relies on: a release that renames one fails here, not silently in a run (pyproject.toml also caps
Lightning below its next minor release)."""

from __future__ import annotations

import inspect

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop


def test_the_epoch_loops_private_names_are_there():
    loop = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False).fit_loop.epoch_loop
    assert isinstance(loop, _TrainingEpochLoop)
    # skip_lightning_sigterm_broadcast (disttrain.rank.trainer); the torchft kind's step counter and results
    for name in ("_broadcast_sigterm_tensor", "_batches_that_stepped", "_results"):
        assert hasattr(loop, name), name
    assert "_batches_that_stepped" in loop.state_dict()["state_dict"]  # restored from a checkpoint's loop state


def test_model_checkpoints_private_methods_are_there():
    # NewestAndBestCheckpoint (disttrain.rank.callbacks) overrides and calls these
    for name in ("_save_topk_checkpoint", "_save_last_checkpoint", "_save_checkpoint", "_monitor_candidates",
                 "_should_save_on_train_epoch_end"):
        assert callable(getattr(ModelCheckpoint, name, None)), name
    assert list(inspect.signature(ModelCheckpoint._save_last_checkpoint).parameters) == [
        "self", "trainer", "monitor_candidates"]


def test_a_logged_results_step_cache_is_the_name_the_torchft_kind_clears():
    # forget_step_values (disttrain.rank.kinds.torchft) sets it to None on each step-logged result
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultMetric

    source = inspect.getsource(_ResultMetric)
    assert "self._forward_cache: Optional[Any] = None" in source  # set per step, read for the logger's row
