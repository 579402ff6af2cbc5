"""What a rank's run leaves: the test of the best checkpoint and ``results.json`` with the run summary."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from disttrain.config.run import RunConfig
from disttrain.fault.config import RESTARTS_FILE
from disttrain.rank.callbacks import ThroughputMeter
from disttrain.report.console import run_summary, skipped_steps_warning
from disttrain.report.plots import write_run_plots
from disttrain.report.results_file import RESULTS_FILE


@dataclass
class Fitted:
    """What ``fit`` left, read before a test replaces Lightning's metrics."""

    metrics: dict[str, float]
    """The last logged scalar metrics (a test adds its own)."""
    seconds: float
    """Wall time of the training steps."""
    steps: int
    """Optimiser steps this process took (fewer than the global step after a resume)."""

    @classmethod
    def of(cls, trainer: pl.Trainer, meter: ThroughputMeter) -> Fitted:
        """Read from the Trainer and the throughput meter right after fit."""
        return cls(scalars(trainer.callback_metrics), meter.wall_time_s, trainer.global_step - meter.start_step)


def test_best(trainer: pl.Trainer, task: pl.LightningModule, datamodule: Any, fitted: Fitted) -> float:
    """Test the best checkpoint (the last weights where none is ranked), add its metrics to ``fitted``'s and
    return the seconds it took."""
    started = time.perf_counter()
    checkpoint = trainer.checkpoint_callback
    best = checkpoint.best_model_path if checkpoint is not None else ""
    trainer.test(task, datamodule=datamodule, ckpt_path=best or None, verbose=False)
    fitted.metrics.update(scalars(trainer.callback_metrics))
    return time.perf_counter() - started


def close_loggers(trainer: pl.Trainer) -> None:
    """Close runs that would report at interpreter exit, after the summary."""
    for logger in trainer.loggers:
        if trainer.is_global_zero and hasattr(logger.experiment, "finish"):
            logger.experiment.finish()


def run_results(run: RunConfig, trainer: pl.Trainer, fitted: Fitted, meter: ThroughputMeter,
                test_s: float) -> dict[str, Any]:
    """The sections of ``results.json`` that every kind of run has."""
    cfg = run.train
    checkpoint = trainer.checkpoint_callback
    metrics = fitted.metrics
    monitor = cfg.optimized_metric or (checkpoint.monitor if checkpoint is not None else None)
    objective = metrics.get(monitor) if monitor else None
    if checkpoint is not None and checkpoint.monitor == monitor and checkpoint.best_model_score is not None:
        objective = float(checkpoint.best_model_score)  # the sweeper optimises the best, not the last, value
    saves = trainer.strategy.checkpoints
    results: dict[str, Any] = {
        "metrics": metrics,
        "wall_time_s": round(fitted.seconds, 3),
        "global_steps": trainer.global_step,
        "samples_per_sec": _finite(meter.samples_per_sec),
        "tokens_per_sec": _finite(meter.tokens_per_sec) if meter.tokens_per_sample > 1 else None,
        "world_size": run.layout.world_size,
        "parallel": {"pp": run.layout.pp, "dp_replicate": run.layout.dp_replicate,
                     "dp_shard": run.layout.dp_shard, "cp": run.layout.cp, "tp": run.layout.tp, "ep": run.layout.ep},
        "batch": {"global": run.batch.global_size, "micro": run.batch.micro_size,
                  "accumulation": run.batch.accumulation},
        "device": str(trainer.strategy.root_device),
        "memory": device_memory(trainer.strategy.root_device),
        "precision": cfg.trainer.precision,
        "compiled": cfg.trainer.compile,
        "compile_mode": cfg.trainer.compiled_mode,
        "compile_scope": cfg.trainer.compile_scope if cfg.trainer.compile else None,
        "torch": torch.__version__,
        "config_hash": run.config_hash,
        # the file the weights started from, as the job checked it: a result traced to its initial weights
        "init_weights": dataclasses.asdict(run.init_weights) if run.init_weights is not None else None,
        "best_checkpoint": (checkpoint.best_model_path or None) if checkpoint is not None else None,
        "best": ({"metric": checkpoint.monitor, "value": float(checkpoint.best_model_score)}
                 if checkpoint is not None and checkpoint.best_model_score is not None else None),
    }
    if cfg.expect is not None:
        results["expect"] = _check_expectation(cfg.expect, metrics)
    results["objective"] = objective
    results["objective_metric"] = monitor
    results["throughput"] = meter.breakdown(trainer, fitted.steps, test_s)
    results["checkpoints"] = {"saves": saves.saves, "blocking_s": round(saves.blocking_s, 3),
                              "share_of_wall_time": round(saves.blocking_s / max(fitted.seconds, 1e-9), 4)}
    return results


def write_results(run: RunConfig, results: dict[str, Any], skipped_steps: int, global_step: int) -> None:
    """Rank 0: write ``results.json`` and the plots, and print the run's summary (and a skipped-steps warning)."""
    cfg = run.train
    results_path = Path(cfg.run_dir) / RESULTS_FILE
    results_path.write_text(json.dumps(results, indent=2) + "\n")
    if cfg.plots:
        write_run_plots(Path(cfg.run_dir), results)
    print(run_summary(results, results_path), flush=True)
    if skipped_steps:
        print(skipped_steps_warning(skipped_steps, global_step), file=sys.stderr, flush=True)


def restart_causes(run_dir: Path) -> list[dict[str, Any]]:
    """The supervisor's record of this run's restarts (empty when it restarted none)."""
    path = run_dir / "logs" / RESTARTS_FILE
    return json.loads(path.read_text()) if path.is_file() else []


def _check_expectation(expect: Any, metrics: dict[str, float]) -> dict[str, Any]:
    value = metrics.get(expect.metric)
    bound = expect.value - expect.tolerance if expect.mode == "max" else expect.value + expect.tolerance
    met = value is not None and (value >= bound if expect.mode == "max" else value <= bound)
    return {"metric": expect.metric, "value": value, "bound": bound, "mode": expect.mode, "met": met}


def reset_device_memory_peak() -> None:
    """Start this run's GPU memory peak from what is held now: a process that ran an earlier fit (a sweep's
    jobs, tests) would report that fit's peak. Nothing where CUDA is not initialised (a fresh rank's peak starts
    at zero, and initialising it here would put a context on GPU 0 before the rank picks its device)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.reset_peak_memory_stats()


def device_memory(device: torch.device) -> dict[str, float] | None:
    """This rank's peak GPU memory over the run, in GB: what tensors held (``max_allocated_gb``) and what the
    caching allocator took from the device (``max_reserved_gb``); None on a CPU, where torch counts neither."""
    if device.type != "cuda":
        return None
    return {"max_allocated_gb": round(torch.cuda.max_memory_allocated(device) / 1e9, 3),
            "max_reserved_gb": round(torch.cuda.max_memory_reserved(device) / 1e9, 3)}


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The one-number metrics of Lightning's ``callback_metrics`` (without its step and epoch counters)."""
    return {key: float(value) for key, value in metrics.items() if value.numel() == 1 and key not in ("step", "epoch")}


def _finite(value: float) -> float | None:
    return round(value, 3) if math.isfinite(value) else None
