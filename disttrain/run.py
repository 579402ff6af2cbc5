"""The runner: a composed config in, a trained run directory and the sweeper's metric out."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from lightning.pytorch.callbacks import LearningRateMonitor
from omegaconf import DictConfig, OmegaConf

from disttrain.callbacks import NewestAndBestCheckpoint, PlainProgress, SummaryWithoutFlops, ThroughputMeter
from disttrain.comm.meter import comm_meter_of
from disttrain.comm.state import ExchangeStateCheckpoint
from disttrain.config import ExecutionPlan, RunConfig, parallel_options, validate
from disttrain.console import quiet_noise, run_summary, skipped_steps_warning
from disttrain.energy import EnergyMeter
from disttrain.fault.rng import RandomStates
from disttrain.fault.steps import StepAgreement, StepDecisions
from disttrain.fault.watchdog import RankWatchdog
from disttrain.federated.plot import write_round_plot
from disttrain.hook_dispatch import NoProfiler
from disttrain.launch import (
    external_environment,
    init_process_group,
    rank_environment,
    rank_layout,
    shutdown_process_group,
    single_rank_environment,
    spawn_and_run,
)
from disttrain.parallel.local_sgd import OuterSteps
from disttrain.parallel.param_server import ServerTraffic
from disttrain.plots import write_run_plots
from disttrain.timing import record_command_start

CONFIG_FILE = "config.yaml"
RESULTS_FILE = "results.json"


def train(cfg: DictConfig) -> float | None:
    """Validate ``cfg``, start its ranks, train, test, write the run directory; return the optimised metric.

    Called by ``train.py`` in the Hydra job process. Every check happens here, before any worker starts.
    """
    env = external_environment()
    if env is not None:  # torchrun / SLURM started every rank, and each of them composed the config
        parallel = parallel_options(cfg)
        init_process_group(env, parallel.backend, parallel.timeout_s)
        _adopt_run_dir(cfg, _agree_on_run_dir(Path(cfg.run_dir)))  # before the one validation
        run = validate(cfg)
        if env.global_rank() == 0:
            (Path(run.train.run_dir) / CONFIG_FILE).write_text(run.yaml)
        return run_rank(run)
    record_command_start()
    run = validate(cfg)
    run_dir = Path(run.train.run_dir)
    for notice in run.notices:
        print(notice, flush=True)
    if run.train.mode == "plan":
        from disttrain.plan.planner import print_plan

        print_plan(run)
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / CONFIG_FILE
    config_path.write_text(run.yaml)
    restarts = run.train.fault_tolerance.max_restarts
    if run.dims.world_size == 1 and not restarts:  # nothing to supervise: train in this process
        with rank_environment(single_rank_environment()):
            return run_rank(run)
    spawn_and_run(run.dims.world_size, config_path, run_dir / "logs", restarts, run.train.trainer.rank_start)
    return json.loads((run_dir / RESULTS_FILE).read_text())["objective"]


def run_worker(config_path: Path) -> None:
    """Entry point of a worker rank started by ``spawn_and_run``: the resolved config, no Hydra."""
    cfg = OmegaConf.load(config_path)
    run = validate(cfg)
    run_rank(run)


def run_rank(run: RunConfig) -> float | None:
    """Train on this rank (the process group may already exist); rank 0 writes ``results.json``."""
    from disttrain.models import build_model
    from disttrain.pipeline_task import PipelineTask
    from disttrain.task import TrainTask

    cfg = run.train
    quiet_noise()
    ft = cfg.fault_tolerance
    agreement = StepAgreement(ft.nan_policy, Path(cfg.run_dir) / "checkpoints")
    agreement.install()  # from now on a preemption signal is a request to stop at a step, not an instant death
    watchdog = RankWatchdog(ft.hang_timeout_s)
    try:
        pl.seed_everything(cfg.seed, workers=True, verbose=False)
        plan, datamodule = run.plan, run.datamodule
        datamodule.accumulation = run.batch.accumulation
        datamodule.full_eval_batches = plan.full_eval_batches
        spec = datamodule.spec
        net = build_model(run.model, spec)
        task_args = (net, spec, run.optim, run.scheduler)
        slot = pipeline_slot(plan)
        if slot is not None:
            task = PipelineTask(*task_args, total_steps=_total_steps(run, datamodule), agreement=agreement,
                                pipeline=slot, accumulation=run.batch.accumulation,
                                clip=cfg.trainer.gradient_clip_val, loss_ranks=plan.loss_ranks, plots=cfg.plots)
        elif cfg.federated.enabled:
            task, datamodule = federated_task(run, datamodule, task_args, agreement)
        else:
            task = TrainTask(*task_args, total_steps=_total_steps(run, datamodule), agreement=agreement,
                             gradients_agree=not cfg.parallel.exchanges_outside_ddp)
        meter = ThroughputMeter(run.batch.global_size, spec.block_size if spec.kind == "text" else 1)
        steps_per_epoch = cfg.federated.rounds if cfg.federated.enabled \
            else datamodule.num_train_samples // run.batch.global_size
        trainer = build_trainer(run, task, slot, meter, steps_per_epoch,
                                [watchdog, RandomStates(), StepDecisions(agreement)])
        comm_meter = comm_meter_of(cfg.comm, trainer.strategy)
        outer = OuterSteps(cfg.parallel.sync_every, cfg.parallel.outer, trainer.strategy.comm_counter)
        traffic = ServerTraffic(cfg.parallel.servers, Path(cfg.run_dir) / "logs")
        energy = EnergyMeter(cfg.trainer.log_every_n_steps)
        trainer.callbacks += [*([energy] if cfg.energy else []), *([outer] if cfg.parallel.sync_every else []),
                              *([traffic] if cfg.parallel.servers else []), comm_meter,
                              ExchangeStateCheckpoint(trainer.strategy.comm_state)]
        restart = restart_count()
        resume = resume_path("auto" if restart else cfg.resume, Path(cfg.run_dir), announce=trainer.is_global_zero)
        trainer.fit(task, datamodule=datamodule, ckpt_path=resume)
        trainer.strategy.wait_for_checkpoint()  # the last save lands before testing from it
        fit_seconds = meter.wall_time_s
        metrics = _scalars(trainer.callback_metrics)  # the test below replaces Lightning's metrics
        checkpoint = trainer.checkpoint_callback
        steps_done = trainer.global_step - meter.start_step
        test_started = time.perf_counter()
        if cfg.trainer.run_test:
            best = checkpoint.best_model_path if checkpoint is not None else ""
            trainer.test(task, datamodule=datamodule, ckpt_path=best or None, verbose=False)
            metrics.update(_scalars(trainer.callback_metrics))
        test_s = time.perf_counter() - test_started
        for logger in trainer.loggers:  # close runs that would report at interpreter exit, after the summary
            if trainer.is_global_zero and hasattr(logger.experiment, "finish"):
                logger.experiment.finish()
        results = _results(run, trainer, metrics, fit_seconds, meter)
        results["throughput"] = meter.breakdown(trainer, steps_done, test_s)
        if cfg.energy:
            results["energy"] = energy.result(steps_done, run.batch.global_size)
        strategy = trainer.strategy
        if not cfg.federated.enabled:  # clients' updates are counted in results["federated"]
            results["comm"] = comm_meter.result
        if cfg.parallel.servers:
            results["param_server"] = traffic.result
        if cfg.federated.enabled:
            results["federated"] = task.summary()
            results["samples_per_sec"] = None  # global batches do not apply: see federated.client_samples_per_sec
            if trainer.is_global_zero and cfg.plots:
                write_round_plot(results["federated"]["history"], Path(cfg.run_dir) / "plots")
        if cfg.parallel.sync_every:
            results["outer_steps"] = {"sync_every": cfg.parallel.sync_every, "count": outer.syncs}
        results["checkpoints"] = {"saves": strategy.checkpoint_saves,
                                  "blocking_s": round(strategy.checkpoint_blocking_s, 3),
                                  "share_of_wall_time": round(strategy.checkpoint_blocking_s / max(fit_seconds, 1e-9),
                                                              4)}
        results["fault_tolerance"] = {"restarts": restart, "restart_causes": _restart_causes(Path(cfg.run_dir)),
                                      "skipped_steps": agreement.skipped_steps}
        if trainer.is_global_zero:
            results_path = Path(cfg.run_dir) / RESULTS_FILE
            results_path.write_text(json.dumps(results, indent=2) + "\n")
            if cfg.plots:
                write_run_plots(Path(cfg.run_dir), results)
            print(run_summary(results, results_path), flush=True)
            if agreement.skipped_steps:
                print(skipped_steps_warning(agreement.skipped_steps, trainer.global_step), file=sys.stderr,
                      flush=True)
        return results["objective"]
    finally:
        watchdog.stop()
        shutdown_process_group()


def federated_task(run: RunConfig, datamodule: Any, task_args: tuple, agreement: StepAgreement) -> tuple[Any, Any]:
    """The task whose training step is a federated round, and the data module that counts rounds."""
    from disttrain.federated.task import FederatedTask, RoundsData, client_partitions

    cfg = run.train
    train_set = datamodule.datasets["train"]
    parts, _ = client_partitions(cfg.federated, train_set, cfg.seed)
    task = FederatedTask(*task_args, fed=cfg.federated, train_set=train_set, parts=parts,
                         clip=cfg.trainer.gradient_clip_val, seed=cfg.seed, agreement=agreement)
    return task, RoundsData(datamodule, cfg.federated.rounds)


def pipeline_slot(plan: ExecutionPlan) -> Any:
    """What the strategy and the pipelined task share (None for a run without pipeline stages)."""
    from functools import partial

    from disttrain.parallel.pipeline.runtime import PipelineSlot, scaled_cross_entropy

    if not plan.pipelined:
        return None
    example = torch.zeros(plan.microbatch_shape, dtype=getattr(torch, plan.microbatch_dtype))
    return PipelineSlot(partial(scaled_cross_entropy, divisor=plan.loss_divisor), example)


def build_trainer(run: RunConfig, task: Any, pipeline: Any, meter: ThroughputMeter, steps_per_epoch: int,
                  fault_callbacks: list[pl.Callback] = ()) -> pl.Trainer:
    """The Lightning Trainer of a validated run: strategy, loggers, checkpoints, progress and callbacks."""
    from disttrain.parallel.strategy import DistTrainStrategy

    cfg = run.train
    t = cfg.trainer
    plan = run.plan
    monitor, mode = (cfg.checkpoint.monitor, _mode_of(cfg.checkpoint.monitor)) if cfg.checkpoint.monitor \
        else task.monitor
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
    interactive = sys.stdout.isatty()
    if interactive:
        callbacks.append(SummaryWithoutFlops())
    if not interactive:
        callbacks.append(PlainProgress(t.log_every_n_steps, meter))
    loggers = [instantiate(node) for node in cfg.logger.values() if node]
    extra = [instantiate(node) for node in cfg.callbacks.values() if node]
    # a learning-rate monitor writes to loggers and refuses to run without one (logger=none)
    callbacks += [c for c in extra if loggers or not isinstance(c, LearningRateMonitor)]
    devices, num_nodes = rank_layout(t.devices, t.num_nodes)
    trainer = pl.Trainer(
        accelerator="gpu" if t.accelerator == "cuda" else t.accelerator,
        devices=devices,
        num_nodes=num_nodes,
        strategy=DistTrainStrategy(cfg.parallel, run.dims, t.precision, getattr(run.model, "sync_batchnorm", False),
                                   pipeline, cfg.checkpoint.async_save, cfg.comm, t.compile),
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
        num_sanity_val_steps=t.num_sanity_val_steps,
        deterministic=t.deterministic or None,
        use_distributed_sampler=False,  # the datamodules shard data by the mesh's data-parallel ranks
        logger=loggers or False,
        callbacks=callbacks,
        enable_progress_bar=interactive,
        enable_model_summary=False,  # SummaryWithoutFlops is added instead when interactive
        default_root_dir=cfg.run_dir,
        profiler=NoProfiler(),
    )
    skip_lightning_sigterm_broadcast(trainer)
    return trainer


def skip_lightning_sigterm_broadcast(trainer: pl.Trainer) -> None:
    """Stop Lightning broadcasting its SIGTERM flag from rank 0 before every training batch (a collective and a
    host sync per step, 9% of a small CNN's DDP step on 2 shared cores). StepAgreement's handlers replace
    Lightning's, so that flag is never set, and ranks agree on preemption at logged steps instead."""
    epoch_loop = trainer.fit_loop.epoch_loop
    if hasattr(epoch_loop, "_broadcast_sigterm_tensor"):  # a private method of Lightning >= 2.5's loop
        epoch_loop._broadcast_sigterm_tensor = lambda: None


def resume_path(resume: str | None, run_dir: Path, announce: bool = True) -> str | None:
    """The checkpoint to continue from: none, the run directory's newest complete one (auto), or a given path.
    ``announce``: print which damaged checkpoints were skipped."""
    from disttrain.fault.checkpoints import newest_complete

    if resume is None:
        return None
    if resume == "auto":
        newest, skipped = newest_complete(run_dir / "checkpoints")
        if announce:
            for warning in skipped:
                print(f"disttrain: {warning}", file=sys.stderr, flush=True)
            if newest is None:
                print(f"disttrain: resume=auto found no complete checkpoint in {run_dir / 'checkpoints'}: starting "
                      "from step 0", file=sys.stderr, flush=True)
        return str(newest) if newest is not None else None
    return resume


def restart_count() -> int:
    """How many times the launcher restarted this run's ranks (torchrun's and disttrain's variable, or a
    SLURM requeue's); a restarted rank resumes from the newest complete checkpoint."""
    import os

    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT") or os.environ.get("SLURM_RESTART_COUNT") or 0)


def _restart_causes(run_dir: Path) -> list[dict[str, Any]]:
    from disttrain.fault.supervisor import RESTARTS_FILE

    path = run_dir / "logs" / RESTARTS_FILE
    return json.loads(path.read_text()) if path.is_file() else []


def _mode_of(metric: str) -> str:
    return "min" if any(word in metric for word in ("loss", "ppl", "bpb", "err")) else "max"


def _total_steps(run: RunConfig, datamodule: Any) -> int:
    """Optimiser steps of the whole run (sets the length of the learning-rate schedule)."""
    t = run.train.trainer
    if t.max_steps > 0:
        return t.max_steps
    return max(1, t.max_epochs * (datamodule.num_train_samples // run.batch.global_size))


def _results(run: RunConfig, trainer: pl.Trainer, metrics: dict[str, float], seconds: float,
             meter: ThroughputMeter) -> dict[str, Any]:
    cfg = run.train
    checkpoint = trainer.checkpoint_callback
    monitor = cfg.optimized_metric or (checkpoint.monitor if checkpoint is not None else None)
    objective = metrics.get(monitor) if monitor else None
    if checkpoint is not None and checkpoint.monitor == monitor and checkpoint.best_model_score is not None:
        objective = float(checkpoint.best_model_score)  # the sweeper optimises the best, not the last, value
    results: dict[str, Any] = {
        "metrics": metrics,
        "wall_time_s": round(seconds, 3),
        "global_steps": trainer.global_step,
        "samples_per_sec": _finite(meter.samples_per_sec),
        "tokens_per_sec": _finite(meter.tokens_per_sec) if meter.tokens_per_sample > 1 else None,
        "world_size": run.dims.world_size,
        "parallel": {"pp": run.dims.pp, "dp_replicate": run.dims.dp_replicate,
                     "dp_shard": run.dims.dp_shard, "tp": run.dims.tp},
        "batch": {"global": run.batch.global_size, "micro": run.batch.micro_size,
                  "accumulation": run.batch.accumulation},
        "device": str(trainer.strategy.root_device),
        "precision": cfg.trainer.precision,
        "compiled": cfg.trainer.compile,
        "torch": torch.__version__,
        "config_hash": run.config_hash,
        "best_checkpoint": (checkpoint.best_model_path or None) if checkpoint is not None else None,
        "best": ({"metric": checkpoint.monitor, "value": float(checkpoint.best_model_score)}
                 if checkpoint is not None and checkpoint.best_model_score is not None else None),
    }
    if cfg.expect is not None:
        results["expect"] = _check_expectation(cfg.expect, metrics)
    results["objective"] = objective
    results["objective_metric"] = monitor
    return results


def _check_expectation(expect: Any, metrics: dict[str, float]) -> dict[str, Any]:
    value = metrics.get(expect.metric)
    bound = expect.value - expect.tolerance if expect.mode == "max" else expect.value + expect.tolerance
    met = value is not None and (value >= bound if expect.mode == "max" else value <= bound)
    return {"metric": expect.metric, "value": value, "bound": bound, "mode": expect.mode, "met": met}


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    return {key: float(value) for key, value in metrics.items() if value.numel() == 1 and key not in ("step", "epoch")}


def _finite(value: float) -> float | None:
    return round(value, 3) if math.isfinite(value) else None


def _agree_on_run_dir(own: Path) -> Path:
    """Under an external launcher every rank ran Hydra: all adopt rank 0's directory and drop their own."""
    import shutil

    import torch.distributed as dist

    chosen = [str(own)]
    dist.broadcast_object_list(chosen, src=0)
    agreed = Path(chosen[0])
    if dist.get_rank() == 0:
        agreed.mkdir(parents=True, exist_ok=True)
    elif own.resolve() != agreed.resolve() and own.exists():
        shutil.rmtree(own, ignore_errors=True)  # only Hydra's bookkeeping was written there
    dist.barrier()
    return agreed


def _adopt_run_dir(cfg: DictConfig, run_dir: Path) -> None:
    # loggers' save_dir interpolate ${run_dir}, so they follow when the config is resolved in validation
    OmegaConf.update(cfg, "run_dir", str(run_dir))
