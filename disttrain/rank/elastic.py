"""A run resumed on another number of ranks: its loop counters follow the new layout, it says what changed, and
it keeps the history of such changes for ``results.json``.

The data module reads its position in global samples on any data-parallel size (``disttrain.data.position``);
what Lightning restores of its epoch loop is in micro-batches of the saving run, and is rewritten here
(``disttrain.checkpoint.elastic``) before the loops load it.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn

from disttrain.checkpoint.elastic import reopen_cut_epoch, rewrite_batch_progress
from disttrain.data.position import batches_done
from disttrain.rank.lightning_data import data_module_of


class ElasticResume(pl.Callback):
    """Aligns a resumed run's loop counters with its own micro-batches and records changes of the world size."""

    def __init__(self) -> None:
        self.world: int | None = None
        """This run's ranks (known once the Trainer is set up)."""
        self.dp: int | None = None
        """Its data-parallel ranks."""
        self.changes: list[dict[str, int]] = []
        """Every change of ranks over the run's history: ``from_ranks``, ``to_ranks``, ``from_dp``, ``to_dp``
        and ``at_step`` (the step the run resumed from)."""
        self.notice: str | None = None
        """The line this resume printed, if the data-parallel size changed."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Note this run's world and data-parallel size (the mesh exists by now)."""
        self.world = trainer.world_size
        data = data_module_of(trainer)
        self.dp = data.replicas(train=True)[0] if data is not None else trainer.world_size

    def state_dict(self) -> dict[str, Any]:
        """The ranks this checkpoint was written by and the changes before it."""
        return {"world": self.world, "dp": self.dp, "changes": list(self.changes)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Nothing to do: ``on_load_checkpoint`` reads the state before Lightning calls this."""

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """A save at the end of a fit that ``max_steps`` cut inside an epoch is written as the save point inside
        the epoch that it is, so a run resumed with more steps continues the epoch (``reopen_cut_epoch``)."""
        datamodule = trainer.datamodule
        position = checkpoint.get(type(datamodule).__qualname__, {}) if datamodule is not None else {}
        reopen_cut_epoch(checkpoint.get("loops", {}).get("fit_loop", {}), position)

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """Rewrite the checkpoint's epoch-loop counters to this run's micro-batches (the loops load after the
        callbacks), record a change of ranks, and say on rank 0 what a change of data-parallel size changed."""
        if trainer.state.fn != TrainerFn.FITTING:  # testing the best checkpoint resumes nothing
            return
        saved = checkpoint.get("callbacks", {}).get(self.state_key) or {}
        self.changes = list(saved.get("changes", []))
        data = data_module_of(trainer)
        if data is None:
            return
        position = checkpoint.get(type(trainer.datamodule).__qualname__) or {}
        micro, accumulation, dp = data.micro_batch_size, data.accumulation, self.dp
        batches = batches_done(position, micro, dp)
        if batches is not None and "accumulation" in position:
            rewrite_batch_progress(checkpoint.get("loops", {}).get("fit_loop", {}), batches,
                                   int(position["accumulation"]), accumulation)
        world_before = saved.get("world") or None
        dp_before = position.get("dp", saved.get("dp"))
        if (world_before is not None and world_before != self.world) or (dp_before is not None and dp_before != dp):
            self.changes.append({"from_ranks": world_before or dp_before, "to_ranks": self.world,
                                 "from_dp": dp_before or world_before, "to_dp": dp,
                                 "at_step": int(checkpoint.get("global_step", 0))})
        if dp_before is not None and dp_before != dp and "micro_size" in position:
            self.notice = changed_layout(int(dp_before), int(position["micro_size"]),
                                         int(position.get("accumulation", 1)), dp, micro, accumulation)
            if trainer.is_global_zero:
                print(self.notice, flush=True)


def changed_layout(dp_before: int, micro_before: int, accumulation_before: int, dp: int, micro: int,
                   accumulation: int) -> str:
    """One line: ``resumed on 2 data-parallel ranks instead of 4: accumulation 1 -> 2, global batch 64 kept``."""
    changes = [f"{what} {before} -> {now}" for what, before, now in
               (("micro-batch", micro_before, micro), ("accumulation", accumulation_before, accumulation))
               if before != now]
    global_before, global_now = dp_before * micro_before * accumulation_before, dp * micro * accumulation
    changes.append(f"global batch {global_now} kept" if global_before == global_now
                   else f"global batch {global_before} -> {global_now}")
    return f"resumed on {dp} data-parallel ranks instead of {dp_before}: {', '.join(changes)}"
