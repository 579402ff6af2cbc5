"""Callbacks the runner adds: checkpoints, throughput measurement, the model summary and the score of the starting
weights."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any
from weakref import proxy

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.trainer.states import TrainerFn

from disttrain.checkpoint.sharded import SameStateAs
from disttrain.lightning_internals import ModelCheckpointSteps, summary_table, validation_follows
from disttrain.parallel.strategy import DistTrainStrategy


class NewestAndBestCheckpoint(ModelCheckpointSteps):
    """Save points and the ranking of checkpoints, kept apart.

    A save point writes the newest state to ``last.ckpt`` (keeping ``keep_last`` of them): every
    ``every_n_train_steps`` optimiser steps, after each validation (or at each epoch end where validation runs
    once an epoch), and at the end of fit. It does not wait for anything to be monitored: Lightning 2.6 defers
    a step save point until its monitored metric exists, and rewrites ``last.ckpt`` only beside a top-k save,
    so a crash lost the steps since the start or since the metric last improved.

    Ranking (``step<N>.ckpt``, the ``save_top_k`` best) happens only at a save point right after a validation,
    by the score that validation measured on the weights being saved. A step save point between validations
    has no score of its own and is not ranked (Lightning would rank it by the previous validation's score).
    Where that save point also writes ``last.ckpt``, the state is the one just ranked: its shards are linked from
    ``step<N>.ckpt``, not written again (``SameStateAs``).
    """

    def __init__(self, *args: Any, keep_last: int = 1, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.keep_last = keep_last
        """Save points kept: ``last.ckpt`` and up to ``keep_last - 1`` earlier ones (``last-step<N>.ckpt``)."""
        self.last_step_written = -1
        """The global step of the newest ``last.ckpt`` this run wrote (-1: none yet)."""
        self.validated_step = -1
        """The global step of the newest validation in this fit (-1: none yet): its scores describe the weights
        of that step only."""
        self.ranked_step = -1
        """The global step of the newest checkpoint this run ranked (-1: none yet)."""
        self.blocking_s = 0.0
        """Seconds this process's saves held training up (gathering the state and writing or staging it)."""
        self._same_state_as: str | None = None
        """The checkpoint this save point has already written (the ranked one), while it writes ``last.ckpt``."""
        self._state_key = super().state_key
        self._step_at_batch_end = 0

    @property
    def state_key(self) -> str:
        """Lightning's key for this callback, built once: Lightning reads it at every hook call, dozens per step,
        and builds it from five settings that do not change after construction."""
        return self._state_key

    def write_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        """Lightning's write, or, while ``last.ckpt`` saves the state just ranked, a link to its shards; timed."""
        started = time.perf_counter()
        if self._same_state_as is None:
            super().write_checkpoint(trainer, filepath)
        else:  # Lightning's own steps, within the strategy's link to the shards already written
            with trainer.strategy.linking_state(SameStateAs(self._same_state_as)):
                trainer.save_checkpoint(filepath, self.save_weights_only)
            self.note_written(trainer, filepath)
            if trainer.is_global_zero:
                for logger in trainer.loggers:
                    logger.after_save_checkpoint(proxy(self))
        self.blocking_s += time.perf_counter() - started

    def save_newest(self, trainer: pl.Trainer) -> None:
        """Write ``last.ckpt`` now (a preemption's save point), also when ``save_last`` is off."""
        if self.last_step_written == trainer.global_step:
            return
        saved, self.save_last = self.save_last, True
        try:
            self.save_last_checkpoint(trainer, self.monitor_candidates(trainer))
        finally:
            self.save_last = saved

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Note the step training starts from (a resumed run's checkpoint holds it already)."""
        super().on_train_start(trainer, pl_module)
        self._step_at_batch_end = trainer.global_step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        """A save point every ``every_n_train_steps`` optimiser steps (the runner sets no time interval), at the
        batch that took the step; where a validation follows this batch, the save point waits for it, so that
        ``last.ckpt`` holds its ranking."""
        every = self.steps_between_saves
        # a batch that only accumulates keeps the step number: after a resume its step is the checkpoint's own,
        # and a save there would hold half an accumulation window
        stepped, self._step_at_batch_end = trainer.global_step != self._step_at_batch_end, trainer.global_step
        if every >= 1 and stepped and trainer.global_step % every == 0 and not validation_follows(trainer):
            self._save_point(trainer)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Note the step whose weights were just scored; a save point unless epoch ends are the save points."""
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        self.validated_step = trainer.global_step
        if not self.saves_at_epoch_end(trainer):
            self._save_point(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A save point where validation runs once an epoch (it ran just before) or not at all."""
        if self.saves_at_epoch_end(trainer):
            self._save_point(trainer)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The final state, also when the run stops between save points (``max_steps`` mid-epoch)."""
        self._save_point(trainer)

    def _save_point(self, trainer: pl.Trainer) -> None:
        step = trainer.global_step
        if step == 0 or trainer.sanity_checking or trainer.fast_dev_run or trainer.state.fn != TrainerFn.FITTING:
            return
        ranks = self.validated_step == step and self.ranked_step != step
        writes_last = self.save_last and self.last_step_written != step
        if not ranks and not writes_last:  # the candidates copy every logged value: built for nothing otherwise
            return
        candidates = self.monitor_candidates(trainer)
        ranked = None
        if ranks:
            self.ranked_step = step
            saved_before = self.newest_file
            self.save_ranked(trainer, candidates)
            # written now only where the score made the top k; nothing changes the state between the two saves
            ranked = self.newest_file if self.newest_file != saved_before else None
        if writes_last:
            self._same_state_as = ranked
            try:
                self.save_last_checkpoint(trainer, candidates)
            finally:
                self._same_state_as = None

    def save_last_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict[str, torch.Tensor]) -> None:
        """Lightning's save of ``last.ckpt``, after retiring the previous one (``keep_last`` are kept)."""
        strategy = trainer.strategy  # under torchft, one of several replica groups writes
        writes = not isinstance(strategy, DistTrainStrategy) or strategy.writes_checkpoints()
        if self.save_last and trainer.is_global_zero and self.dirpath is not None and writes:
            from disttrain.checkpoint.folders import retire_and_prune

            retire_and_prune(Path(self.dirpath), self.keep_last)
        super().save_last_checkpoint(trainer, monitor_candidates)
        if self.save_last:
            self.last_step_written = trainer.global_step


class ThroughputMeter(pl.Callback):
    """Measures training throughput over the whole fit, and where the rest of the wall time went.

    Training time runs from the end of the first (warm-up) optimiser step and leaves out validation and the
    time checkpoint saves blocked training (Lightning saves after validation ends, and at epoch ends).
    Lightning's ThroughputMonitor logs windowed rates straight to the loggers; the run's results need one
    whole-run figure and the breakdown, so this keeps its own totals (a handful of clock reads per step).
    """

    def __init__(self, global_batch: int, tokens_per_sample: int = 1) -> None:
        from disttrain.report.timing import command_start_time

        self.global_batch = global_batch
        self.tokens_per_sample = tokens_per_sample
        self.steps = 0
        self.seconds = 0.0
        """Training seconds since the first step (validation and checkpoint saves left out)."""
        self.validation_s = 0.0
        """Seconds this process spent validating."""
        self.command_start = command_start_time()
        """Wall-clock time the user's command started."""
        self.time_to_first_step_s: float | None = None
        """From the command to the first training batch of this process."""
        self.startup_s: float | None = None
        """From the command to the start of fit (imports, config, data, model, process group)."""
        self.start_step = 0
        """The global step this process's training started from."""
        self._origin: tuple[float, int, float] | None = None  # clock, step, checkpoint seconds at the origin
        self._paused = 0.0
        self._pause_start = 0.0
        self._fit_start = time.perf_counter()
        self._fit_end: float | None = None
        self.earlier_wall_time_s = 0.0
        """Wall time of the run's earlier processes, up to the checkpoint this one resumed from."""

    @property
    def wall_time_s(self) -> float:
        """Wall time of the whole run: earlier processes up to the resumed checkpoint, plus this fit so far."""
        return self.earlier_wall_time_s + time.perf_counter() - self._fit_start

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Start this process's clock."""
        self._fit_start = time.perf_counter()
        self.startup_s = time.time() - self.command_start

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Stop this process's fit clock (testing comes after)."""
        self._fit_end = time.perf_counter()

    def state_dict(self) -> dict[str, float]:
        """Saved with every checkpoint, so a resumed run's wall time counts the time before it."""
        return {"wall_time_s": self.wall_time_s}

    def load_state_dict(self, state_dict: dict[str, float]) -> None:
        """Continue the clock of the checkpoint's run."""
        self.earlier_wall_time_s = float(state_dict.get("wall_time_s", 0.0))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Note the step training starts from (after a resumed checkpoint's)."""
        self.start_step = trainer.global_step

    def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        if self.time_to_first_step_s is None:
            self.time_to_first_step_s = time.time() - self.command_start

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        now = time.perf_counter()
        saving = _checkpoint_seconds(trainer)
        if self._origin is None:
            if trainer.global_step >= 1:  # the clock starts after the first (warm-up) optimiser step
                self._origin = (now, trainer.global_step, saving)
            return
        self.steps = trainer.global_step - self._origin[1]
        self.seconds = now - self._origin[0] - self._paused - (saving - self._origin[2])
        if trainer.global_step % trainer.log_every_n_steps == 0 and self.seconds > 0:
            pl_module.log_dict({"train/samples_per_sec": self.samples_per_sec,
                                "train/tokens_per_sec": self.tokens_per_sec}, on_step=True, on_epoch=False)

    def on_validation_start(self, trainer: pl.Trainer, *_: Any) -> None:
        self._pause_start = time.perf_counter()

    def on_validation_end(self, trainer: pl.Trainer, *_: Any) -> None:
        paused = time.perf_counter() - self._pause_start
        self.validation_s += paused
        if self._origin is not None:
            self._paused += paused

    @property
    def samples_per_sec(self) -> float:
        """Global training samples per second (all ranks together); nan before two steps."""
        return self.steps * self.global_batch / self.seconds if self.seconds > 0 else float("nan")

    @property
    def tokens_per_sec(self) -> float:
        """Global training tokens per second (equal to samples/s for image tasks)."""
        return self.samples_per_sec * self.tokens_per_sample

    def breakdown(self, trainer: pl.Trainer, steps_done: int, test_s: float) -> dict[str, Any]:
        """This process's wall time from the command on, split into startup, training, validation, checkpoint
        saves, test and the rest (Lightning's loop, callbacks, teardown), and the end-to-end throughput."""
        total = time.time() - self.command_start
        fit = (self._fit_end or time.perf_counter()) - self._fit_start
        saving = _checkpoint_seconds(trainer)
        parts = {"startup": self.startup_s or 0.0, "training": max(fit - self.validation_s - saving, 0.0),
                 "validation": self.validation_s, "checkpoints": saving, "test": test_s}
        parts["other"] = max(total - sum(parts.values()), 0.0)
        return {
            "end_to_end_samples_per_sec": round(steps_done * self.global_batch / total, 3) if total > 0 else None,
            "time_to_first_step_s": round(self.time_to_first_step_s, 3) if self.time_to_first_step_s else None,
            "wall_time_s": round(total, 3),
            "seconds": {name: round(value, 3) for name, value in parts.items()},
            "shares": {name: round(value / total, 4) for name, value in parts.items()} if total > 0 else {},
        }


def _checkpoint_seconds(trainer: pl.Trainer) -> float:
    """Seconds checkpoint saves have blocked training in this process (each checkpoint callback times its own)."""
    return float(sum(getattr(callback, "blocking_s", 0.0) for callback in trainer.checkpoint_callbacks))


class SummaryWithoutFlops(ModelSummary):
    """Lightning's model summary without its FLOPs column and total.

    Lightning counts FLOPs only by running an example input through the model on rank 0 alone, which
    would hang a sharded model waiting for its peers; without one it prints zeros that read as a
    measurement.
    """

    @staticmethod
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int,
                  **summarize_kwargs: Any) -> None:
        """Print the table of layers and parameter counts, leaving FLOPs out unless they were counted."""
        columns = [c for c in summary_data if total_flops or c[0] != "FLOPs"]
        table = summary_table(total_parameters, trainable_parameters, model_size, total_training_modes, total_flops,
                              *columns)
        if not total_flops:
            table = table.rsplit("\n", 1)[0]  # the last line is the "Total Flops" row
        print(table, flush=True)


class ScoreBeforeTraining(pl.Callback):
    """Log and print the validation metrics of Lightning's sanity validation, which runs every validation batch
    before the first step when this callback is added (``trainer.validate_before_training``): the score of the
    weights training starts from, at the starting step. Lightning logs nothing of a sanity validation itself."""

    def on_sanity_check_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Write the task's newest evaluation (``evaluation.latest``, already reduced over the ranks) to every
        logger."""
        metrics = {**pl_module.evaluation.latest, "epoch": float(trainer.current_epoch)}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        if trainer.is_global_zero:
            shown = {key: f"{value:.4f}" for key, value in metrics.items() if key.startswith("val/")}
            print(f"validation before training, at step {trainer.global_step}: {shown}", flush=True)
