"""Every private name of Lightning that disttrain reads, sets or overrides, in this one module.

Each entry says what it needs and why no public API gives it. pyproject.toml caps Lightning below its next minor
release, and tests/test_lightning_internals.py fails the day one of these names changes or one is used outside
this module. Everything else in disttrain uses Lightning through its public API.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table
from torch.distributed.device_mesh import DeviceMesh


def skip_sigterm_broadcast(trainer: pl.Trainer) -> None:
    """Stop Lightning broadcasting its SIGTERM flag from rank 0 before every training batch: a collective and a
    host sync per step that a small data-parallel step feels (benchmarks/README.md, Figures cited elsewhere).
    The runner's own handlers replace Lightning's, so the flag is never set, and ranks agree on preemption at
    logged steps instead. Lightning has no switch for it."""
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None


def validation_follows(trainer: pl.Trainer) -> bool:
    """Whether Lightning validates right after the training batch that just ended: its own decision, asked early
    through its epoch loop (a save point waits for that validation so that it can rank the checkpoint)."""
    fetcher = trainer.fit_loop._data_fetcher
    return fetcher is not None and bool(trainer.fit_loop.epoch_loop._should_check_val_fx(fetcher))


def forget_step_values(trainer: pl.Trainer) -> None:
    """Drop the per-step values logged so far in this epoch (the epoch's aggregates stay): Lightning's logger row
    after this batch, if it writes one, then holds only what this batch logged. Lightning keeps a logged value's
    last step value until the next one replaces it; a batch that took no step must not repeat it in a row."""
    for result in trainer.fit_loop.epoch_loop._results.values():
        if result.meta.on_step:
            result._forward_cache = None


def count_stepped_batches(trainer: pl.Trainer, count: int) -> None:
    """Set Lightning's count of training batches that took an optimiser step, which decides on which batches it
    writes a logger row (every ``log_every_n_steps``): under manual optimisation it counts every batch."""
    trainer.fit_loop.epoch_loop._batches_that_stepped = count


def join_process_group(strategy: Any) -> None:
    """Lightning's own start of the process group for ``ModelParallelStrategy`` (world ranks, backend, timeout,
    seed reset), for a strategy that builds a mesh of its own instead of Lightning's two-dimensional one."""
    strategy._setup_distributed()


def set_device_mesh(strategy: Any, module: pl.LightningModule, mesh: DeviceMesh) -> None:
    """Make ``mesh`` what ``strategy.device_mesh`` and ``module.device_mesh`` return (read-only properties over
    private attributes)."""
    strategy._device_mesh = mesh
    module._device_mesh = mesh


def optimizers_to_device(optimizers: Iterable[torch.optim.Optimizer], device: torch.device) -> None:
    """Move the optimisers' state to ``device`` as Lightning's strategies do after setting them up (their
    ``step`` counters stay where the optimiser keeps them)."""
    _optimizers_to_device(optimizers, device)


def summary_table(total_parameters: int, trainable_parameters: int, model_size: float,
                  training_modes: dict[str, int], total_flops: int, *columns: tuple[str, list[str]]) -> str:
    """Lightning's model summary table, as its ``ModelSummary`` callback prints it."""
    return _format_summary_table(total_parameters, trainable_parameters, model_size, training_modes, total_flops,
                                 *columns)


def wandb_init_options(logger: Any) -> dict[str, Any]:
    """The keyword arguments a ``WandbLogger`` hands to ``wandb.init`` (a dict it builds at construction)."""
    return logger._wandb_init


class ModelCheckpointSteps(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` with the private steps it is built from opened under public names, for a
    subclass that decides itself when to save and what to rank. Lightning calls its private steps; they route to
    the public methods here, which a subclass may override."""

    def _save_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        self.write_checkpoint(trainer, filepath)

    def _save_last_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict[str, torch.Tensor]) -> None:
        self.save_last_checkpoint(trainer, monitor_candidates)

    def write_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        """Write one checkpoint file: every file Lightning's steps save goes through here."""
        super()._save_checkpoint(trainer, filepath)

    def save_last_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict[str, torch.Tensor]) -> None:
        """Lightning's save of ``last.ckpt`` (it writes only where ``save_last`` is set)."""
        super()._save_last_checkpoint(trainer, monitor_candidates)

    def save_ranked(self, trainer: pl.Trainer, monitor_candidates: dict[str, torch.Tensor]) -> None:
        """Lightning's save of a checkpoint ranked by the monitored score (written where it makes the top k)."""
        self._save_topk_checkpoint(trainer, monitor_candidates)

    def monitor_candidates(self, trainer: pl.Trainer) -> dict[str, torch.Tensor]:
        """The values a checkpoint may be ranked by and named with (every logged value, the epoch and step)."""
        return self._monitor_candidates(trainer)

    def note_written(self, trainer: pl.Trainer, filepath: str) -> None:
        """Record a file written without Lightning's own write as that write records it."""
        self._last_global_step_saved = trainer.global_step
        self._last_checkpoint_saved = filepath

    @property
    def newest_file(self) -> str:
        """The path of the checkpoint written last ("" before the first)."""
        return self._last_checkpoint_saved

    @property
    def steps_between_saves(self) -> int:
        """``every_n_train_steps`` as constructed (0: none)."""
        return self._every_n_train_steps

    def saves_at_epoch_end(self, trainer: pl.Trainer) -> bool:
        """Whether Lightning's checkpoint saves at each training epoch's end (validation runs once an epoch, just
        before it, or not at all) rather than after each validation."""
        return self._should_save_on_train_epoch_end(trainer)
