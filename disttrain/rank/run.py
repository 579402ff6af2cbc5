"""A rank's run: its entry point (``python -m disttrain.rank.run CONFIG``) and the straight sequence that builds
the model, data, kind of run and Trainer, fits, tests and writes the results."""

from __future__ import annotations

import os
import sys
import traceback
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.distributed as dist

from disttrain.checkpoint.folders import resume_path
from disttrain.checkpoint.init_weights import start_from_init_weights
from disttrain.comm.state import ExchangeStateCheckpoint
from disttrain.config.resolved import load_rank_file
from disttrain.config.run import RunConfig
from disttrain.errors import SaveFailed
from disttrain.eval.callback import TaskScores
from disttrain.fault.config import LOST_PEER_EXIT, restart_count
from disttrain.fault.replica_groups import group_view, job_world_size
from disttrain.fault.rng import RandomStates
from disttrain.fault.steps import StepAgreement, StepDecisions
from disttrain.fault.stops import NonFiniteStep, Preempted
from disttrain.fault.watchdog import RankWatchdog
from disttrain.models import build_model
from disttrain.observe.collectives import RECORDER
from disttrain.observe.hang import REPORTS_FOLDER
from disttrain.observe.memory_callback import recorded_step
from disttrain.observe.stragglers import StragglerDetector
from disttrain.parallel.process_group import shutdown_process_group
from disttrain.plan.planner import planned_moments
from disttrain.rank.callbacks import ThroughputMeter
from disttrain.rank.elastic import ElasticResume
from disttrain.rank.energy import EnergyMeter
from disttrain.rank.experts import BatchBalanceLoss, ExpertBalance
from disttrain.rank.host_memory import keep_freed_host_memory
from disttrain.rank.kinds import KINDS
from disttrain.rank.lightning_data import lightning_data
from disttrain.rank.results import (
    Fitted,
    close_loggers,
    reset_device_memory_peak,
    restart_causes,
    run_results,
    test_best,
    write_results,
)
from disttrain.rank.trainer import build_trainer
from disttrain.report.console import quiet_noise

LOCKSTEP_KINDS = ("synchronous", "pipelined")
"""Kinds of run whose ranks take every step together: a slow rank slows them all, and is named."""

# what a rank sees when another rank died under it: the consequence, not the cause
PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "connectFullMesh failed")


def run_rank(run: RunConfig) -> float | None:
    """Train on this rank (the process group may already exist); rank 0 writes ``results.json``."""
    cfg = run.train
    quiet_noise()
    if cfg.trainer.keep_freed_host_memory:
        keep_freed_host_memory()
    agreement = StepAgreement(cfg.fault_tolerance.nan_policy, Path(cfg.run_dir) / "checkpoints",
                              defers=cfg.fault_tolerance.nan_check == "next_step")
    agreement.install()  # from now on a preemption signal is a request to stop at a step, not an instant death
    watchdog = RankWatchdog(cfg.fault_tolerance.hang_timeout_s, Path(cfg.run_dir) / "logs" / REPORTS_FOLDER)
    kind = None
    RECORDER.install()  # the last collective entered, for a hang's report; the time blocked in them, for stragglers
    reset_device_memory_peak()
    torch.set_float32_matmul_precision(cfg.trainer.matmul_precision)  # resolved before ranks start (never auto)
    try:
        pl.seed_everything(cfg.seed, workers=True, verbose=False)
        datamodule = run.datamodule
        datamodule.accumulation = run.batch.accumulation
        datamodule.full_eval_batches = run.plan.full_eval_batches
        spec = datamodule.spec
        kind = KINDS[run.plan.kind](run, agreement)
        net = start_from_init_weights(build_model(run.model, spec), run.model)  # before the layout
        balance = ExpertBalance.of(net, run.plan.loss_divisor)
        batch_balance = BatchBalanceLoss.of(net, run.plan.loss_divisor)
        task, datamodule = kind.task(net, datamodule)
        meter = ThroughputMeter(run.batch.global_size, spec.block_size if spec.kind == "text" else 1)
        elastic = ElasticResume()
        # kinds whose ranks step in lockstep; the others' ranks run apart by design
        stragglers = StragglerDetector(cfg.observe.straggler_ratio, cfg.observe.straggler_windows,
                                       cfg.trainer.log_every_n_steps, Path(cfg.run_dir) / "logs") \
            if cfg.observe.stragglers and kind.name in LOCKSTEP_KINDS else None
        trainer = build_trainer(run, task, kind, meter, [watchdog, RandomStates(), StepDecisions(agreement), elastic,
                                                           *([stragglers] if stragglers else [])])
        energy = EnergyMeter(cfg.trainer.log_every_n_steps)
        scores = TaskScores(cfg.eval, run.data.tokenizer, cfg.run_dir, cfg.trainer.validate_before_training) \
            if cfg.eval.enabled else None
        # first: its scoring counts as validation time, and precedes the checkpoint's ranking
        trainer.callbacks[:0] = [scores] if scores else []
        trainer.callbacks += [*([energy] if cfg.energy else []), *([balance] if balance else []),
                              *([batch_balance] if batch_balance else []),
                              *kind.callbacks(trainer.strategy),
                              ExchangeStateCheckpoint(trainer.strategy.comm_state)]
        memory = recorded_step(trainer.callbacks)
        if memory is not None:  # rank 0 draws the plan's moments beside its own
            memory.planned, memory.draw = partial(planned_moments, run), cfg.plots
        restart = restart_count()
        resume = kind.resume_from(trainer) or resume_path("auto" if restart else cfg.resume, Path(cfg.run_dir),
                                                          announce=trainer.is_global_zero)
        data_view = lightning_data(datamodule)
        trainer.fit(task, datamodule=data_view, ckpt_path=resume)
        trainer.strategy.wait_for_checkpoint()  # the last save lands before testing from it
        fitted = Fitted.of(trainer, meter)
        test_s = test_best(trainer, task, data_view, fitted) if cfg.trainer.run_test else 0.0
        close_loggers(trainer)
        results = run_results(run, trainer, fitted, meter, test_s)
        if cfg.energy:
            results["energy"] = energy.result(fitted.steps, run.batch.global_size)
        if balance:
            results["experts"] = balance.result
        if hasattr(run.datamodule, "report"):  # what a data module counted while reading its files
            results["data"] = run.datamodule.report()
        if scores:
            results["eval"] = scores.result
        if stragglers and stragglers.active:
            results["stragglers"] = stragglers.result()
        if memory is not None and memory.result is not None:  # on a CPU torch counts no peak of its own
            results["memory"] = {**(results["memory"] or {}), "recorded_step": memory.result}
        sections = kind.results(trainer)
        results.update(sections)
        results["fault_tolerance"] = {"restarts": restart, "restart_causes": restart_causes(Path(cfg.run_dir)),
                                      "skipped_steps": agreement.skipped_steps,
                                      "world_size_changes": elastic.changes, **sections.get("fault_tolerance", {})}
        if kind.writes_results(trainer):
            write_results(run, results, agreement.skipped_steps, trainer.global_step)
        return results["objective"]
    finally:
        watchdog.stop()
        RECORDER.uninstall()
        if kind is not None:
            kind.close()
        shutdown_process_group()


def run_worker(resolved_path: Path) -> None:
    """A worker rank started by the job process: the run the job validated, read from ``resolved_path`` with the
    decisions for this rank's world (no Hydra, no validation). A torchft replica group reads the whole job's
    decisions and trains its own group's view of them."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    groups_world = job_world_size(world)
    run = load_rank_file(resolved_path.read_text(), world if groups_world is None else groups_world)
    run_rank(run if groups_world is None else group_view(run))


def lost_a_peer(err: BaseException) -> bool:
    """Whether ``err`` is this rank's view of another rank's death (a failed collective or connection)."""
    return isinstance(err, dist.DistError) or (isinstance(err, RuntimeError) and any(
        marker in str(err) for marker in PEER_LOST))


def run_and_exit(config_path: Path) -> None:
    """Run this rank of the run whose resolved config is ``config_path``, then leave the process with the rank's
    exit status (0, a diagnosed code, or 1 after printing the traceback)."""
    code = 0
    try:
        run_worker(config_path)
    except Preempted as stop:
        code = stop.code
    except (NonFiniteStep, SaveFailed) as err:
        print(f"Error: {err}", file=sys.stderr)
        code = err.exit_code
    except Exception as err:  # noqa: BLE001 - every failure ends the rank; only its report differs
        code = 1
        if lost_a_peer(err):  # the supervisor names the rank that failed first; one line here is enough
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            print(f"disttrain: rank {os.environ.get('RANK', '?')} lost contact with another rank: {first}",
                  file=sys.stderr)
            code = LOST_PEER_EXIT
        else:
            traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    # The rank's work is complete and its process group destroyed; C++ threads left by torch.distributed
    # were seen to abort the interpreter's final teardown ("terminate called without an active exception"),
    # which would report a finished rank as failed. Leave without running that teardown.
    os._exit(code)


if __name__ == "__main__":
    run_and_exit(Path(sys.argv[1]))
