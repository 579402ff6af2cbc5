"""What the command line shows: a rejected config is one ``Error:`` line and leaves no run directory."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from disttrain.errors import ConfigError
from disttrain.launch.run_dir_lock import LOCK_FILE, hold_or_exit, release, release_all

HYDRA_BOOKKEEPING = {".hydra", "train.log", LOCK_FILE}
"""What Hydra and the run directory's lock write into a job directory before the job function runs."""

FULL_ERROR = "HYDRA_FULL_ERROR"
"""Hydra's switch for whole tracebacks; while it is "1", Hydra re-raises the errors it would otherwise print."""


class _Composing:
    """Whether :func:`main_with_one_line_errors` is in effect, and whether it has set FULL_ERROR to "1" meanwhile
    (only while Hydra composes a job's config, never while the job runs), over the user's own value if any."""

    wrapped = False
    flag_set = False
    users_value: str | None = None

    @classmethod
    def begin(cls) -> None:
        if cls.wrapped and os.environ.get(FULL_ERROR) != "1":  # only "1" asks for tracebacks; "0" is Hydra's own
            cls.users_value = os.environ.get(FULL_ERROR)
            os.environ[FULL_ERROR], cls.flag_set = "1", True

    @classmethod
    def end(cls) -> None:
        if cls.flag_set:
            if cls.users_value is None:
                os.environ.pop(FULL_ERROR, None)
            else:
                os.environ[FULL_ERROR] = cls.users_value
            cls.flag_set = False


def main_with_one_line_errors(hydra_main: Callable[[], Any], argv: list[str] | None = None,
                              config_name: str | None = None) -> None:
    """Run Hydra's decorated entry point so that a mistake Hydra finds while composing the config (an unknown
    key, a value of the wrong type, a missing group option, an override it cannot parse) is one ``Error:`` line
    and exit status 2, as the framework's own checks are. ``HYDRA_FULL_ERROR=1`` keeps Hydra's traceback.
    ``config_name``: the entry point's config, whose help ``--help`` then prints without Hydra's own slow path
    (``disttrain.launch.help``)."""
    from disttrain.config.composition_errors import COMPOSITION_ERRORS, composition_error_line
    from disttrain.launch.help import help_overrides, print_help

    args = sys.argv[1:] if argv is None else argv
    # Hydra reads the flag when it catches an error, so only errors raised while composing come back here
    _Composing.wrapped = True
    _Composing.begin()
    try:
        overrides = help_overrides(args) if config_name else None
        if overrides is None or not print_help(config_name, overrides):
            hydra_main()
    except COMPOSITION_ERRORS as err:
        if not _Composing.flag_set:
            raise
        print(f"Error: {composition_error_line(err, args)}", file=sys.stderr, flush=True)
        sys.exit(2)
    finally:
        _Composing.end()
        _Composing.wrapped = False
        release_all()  # a run or sweep that ended by an exit leaves its directory free in a process that goes on


def train_from_cli(cfg: DictConfig) -> float | None:
    """``disttrain.launch.job.train(cfg)``; on a ConfigError print ``Error: <message>``, remove the job directory
    Hydra made for it (when it holds nothing else), and exit with status 2. ``HYDRA_FULL_ERROR=1`` raises
    instead, for the whole traceback. The job's directory is this process's while the job runs
    (``run_dir_lock``)."""
    _Composing.end()  # the job's own errors are reported as below, or by Hydra
    held = _hold_job_dir()
    try:
        metric = _train_and_report(cfg)
    finally:
        release(held)
    _Composing.begin()  # a sweep's next job composes its config: its mistakes are one line too
    return metric


def _hold_job_dir() -> Path | None:
    """Lock Hydra's directory of this job for this process (``run_dir_lock.hold``) unless it holds it already:
    Hydra's callback ``run_dir_lock`` did, before Hydra wrote there, where the config names it (this is for a
    config without it, or a launcher that runs each job of a sweep in a process of its own)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return hold_or_exit(HydraConfig.get().runtime.output_dir, "hydra.run.dir")


def _train_and_report(cfg: DictConfig) -> float | None:
    """``train(cfg)``, with its errors as one line and an exit status (see :func:`train_from_cli`)."""
    from disttrain.errors import SaveFailed
    from disttrain.fault.stops import NonFiniteStep, Preempted
    from disttrain.launch.job import train
    from disttrain.launch.supervisor import RanksStopped

    if _may_start_ranks(cfg):  # the fork server imports torch and Lightning while this process does the same
        from disttrain.launch.fork_server import forks_ranks, warm_fork_server

        if forks_ranks(str(OmegaConf.select(cfg, "trainer.rank_start", default="auto"))):
            warm_fork_server()
    try:
        metric = train(cfg)
    except ConfigError as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        discard_job_dir()
        print(f"Error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except (RanksStopped, NonFiniteStep, SaveFailed) as err:  # the ranks' own output above says the rest
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"Error: {err}", file=sys.stderr, flush=True)
        sys.exit(err.exit_code)
    except Preempted as stop:  # one rank's run, or the supervisor of many: one wording, and no "Error"
        print(stop.message, file=sys.stderr, flush=True)
        sys.exit(stop.code)
    return metric


def _may_start_ranks(cfg: DictConfig) -> bool:
    """Whether to start the fork server before validation: this job will likely start worker ranks (more than
    one rank, no outside launcher, not a plan or a dry run), and validation times nothing that the server's
    imports would slow (``trainer.precision=auto`` and ``parallel=auto`` measure this machine). A guess from the
    raw config, made before the imports that validation needs."""
    if "LOCAL_RANK" in os.environ or OmegaConf.select(cfg, "mode") in ("plan", "dryrun"):
        return False
    parallel, devices = OmegaConf.select(cfg, "parallel.name"), OmegaConf.select(cfg, "trainer.devices")
    if parallel == "auto" or OmegaConf.select(cfg, "trainer.precision") == "auto":
        return False
    if devices in (1, "1"):  # one rank trains in this process, whatever the layout: a server's imports only slow it
        return False
    return parallel != "single" or devices != "auto"


def discard_job_dir() -> None:
    """Remove Hydra's directory of this job if it holds only Hydra's own bookkeeping (never a real run's)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return
    job_dir = Path(HydraConfig.get().runtime.output_dir).resolve()
    if not job_dir.is_dir() or not {entry.name for entry in job_dir.iterdir()} <= HYDRA_BOOKKEEPING:
        return
    shutil.rmtree(job_dir, ignore_errors=True)
    # and the folders made for it alone (outputs/runs/...), up to the working directory
    cwd, parent = Path.cwd().resolve(), job_dir.parent
    while parent != cwd and cwd in parent.parents and parent.is_dir():
        if {entry.name for entry in parent.iterdir()} - {"multirun.yaml", LOCK_FILE}:
            break
        shutil.rmtree(parent, ignore_errors=True)
        parent = parent.parent
