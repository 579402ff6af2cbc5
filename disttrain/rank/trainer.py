"""The Lightning Trainer of a validated run: strategy, loggers, checkpoints, progress and callbacks."""

from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor

from disttrain.config.run import RunConfig
from disttrain.lightning_internals import skip_sigterm_broadcast
from disttrain.parallel.process_group import rank_layout
from disttrain.parallel.strategy import DistTrainStrategy
from disttrain.rank.callbacks import (
    NewestAndBestCheckpoint,
    ScoreBeforeTraining,
    SummaryWithoutFlops,
    ThroughputMeter,
)
from disttrain.rank.kinds.base import RunKind
from disttrain.rank.profiler import NoProfiler
from disttrain.rank.progress import PlainProgress, loss_bar


def build_trainer(run: RunConfig, task: pl.LightningModule, kind: RunKind, meter: ThroughputMeter,
                  fault_callbacks: list[pl.Callback] = ()) -> pl.Trainer:
    """The Trainer for ``task``, with a strategy built with what ``kind`` hands it (``RunKind.strategy_hooks``)."""
    cfg = run.train
    t = cfg.trainer
    plan = run.plan
    monitor, mode = (cfg.checkpoint.monitor, mode_of(cfg.checkpoint.monitor)) if cfg.checkpoint.monitor \
        else task.evaluation.monitor
    callbacks: list[pl.Callback] = [
        NewestAndBestCheckpoint(
            dirpath=Path(cfg.run_dir) / "checkpoints",
            filename="step{step}",
            auto_insert_metric_name=False,
            monitor=monitor if cfg.checkpoint.save_top_k else None,
            mode=mode,
            save_top_k=cfg.checkpoint.save_top_k,
            save_last=cfg.checkpoint.save_last,
            every_n_train_steps=cfg.checkpoint.every_n_train_steps,
            keep_last=cfg.checkpoint.keep_last,
        ),
        meter,
        *fault_callbacks,
    ]
    if t.validate_before_training:
        callbacks.append(ScoreBeforeTraining())
    interactive = sys.stdout.isatty()
    callbacks += [SummaryWithoutFlops(), loss_bar()] if interactive else [PlainProgress(t.log_every_n_steps, meter)]
    loggers = [instantiate(node) for node in cfg.logger.values() if node]
    extra = [instantiate(node) for node in cfg.callbacks.values() if node]
    # a learning-rate monitor writes to loggers and refuses to run without one (logger=none)
    callbacks += [c for c in extra if loggers or not isinstance(c, LearningRateMonitor)]
    devices, num_nodes = rank_layout(t.devices, t.num_nodes)
    strategy = DistTrainStrategy(run.layout, cfg.parallel, t.precision, getattr(run.model, "sync_batchnorm", False),
                                 cfg.checkpoint.async_save, cfg.comm, compilation=t.compilation,
                                 hooks=kind.strategy_hooks(), float8=t.float8)
    steps_per_epoch = kind.steps_per_epoch(run.datamodule)
    trainer = pl.Trainer(
        accelerator="gpu" if t.accelerator == "cuda" else t.accelerator,
        devices=devices,
        num_nodes=num_nodes,
        strategy=strategy,
        max_steps=t.max_steps,
        # max_steps sets the length when given; the epochs it takes keep the progress bar's total right
        max_epochs=t.max_epochs if t.max_steps == -1 else -(-t.max_steps // max(1, steps_per_epoch)),
        precision=t.precision,
        gradient_clip_val=plan.trainer_clip,
        accumulate_grad_batches=plan.trainer_accumulation,
        inference_mode=plan.inference_mode,
        val_check_interval=t.val_check_interval,
        check_val_every_n_epoch=t.check_val_every_n_epoch,
        limit_val_batches=t.limit_val_batches,
        limit_test_batches=t.limit_test_batches,
        log_every_n_steps=t.log_every_n_steps,
        # Lightning's sanity validation runs before the first step; -1 takes every batch limit_val_batches allows
        num_sanity_val_steps=-1 if t.validate_before_training else t.num_sanity_val_steps,
        deterministic=t.deterministic or None,
        use_distributed_sampler=False,  # the datamodules shard data by the mesh's data-parallel ranks
        logger=loggers or False,
        callbacks=callbacks,
        enable_progress_bar=interactive,
        enable_model_summary=False,  # SummaryWithoutFlops is added instead when interactive
        default_root_dir=cfg.run_dir,
        profiler=NoProfiler(),
    )
    skip_sigterm_broadcast(trainer)
    return trainer


def mode_of(metric: str) -> str:
    """Whether lower ("min") or higher ("max") is better for ``metric``, by its name."""
    return "min" if any(word in metric for word in ("loss", "ppl", "bpb", "err")) else "max"
