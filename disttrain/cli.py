"""What the command line shows: a rejected config is one ``Error:`` line and leaves no run directory."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from omegaconf import DictConfig

from disttrain.errors import ConfigError

HYDRA_BOOKKEEPING = {".hydra", "train.log"}
"""What Hydra writes into a job directory before the job function runs."""


def train_from_cli(cfg: DictConfig) -> float | None:
    """``disttrain.run.train(cfg)``; on a ConfigError print ``Error: <message>``, remove the job directory
    Hydra made for it (when it holds nothing else), and exit with status 2. ``HYDRA_FULL_ERROR=1`` raises
    instead, for the whole traceback."""
    from disttrain.fault.steps import NonFiniteStep, Preempted
    from disttrain.fault.supervisor import RanksStopped
    from disttrain.run import train

    try:
        return train(cfg)
    except ConfigError as err:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        discard_job_dir()
        print(f"Error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except (RanksStopped, NonFiniteStep) as err:  # the ranks' own output above says the rest
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        print(f"Error: {err}", file=sys.stderr, flush=True)
        sys.exit(err.exit_code)
    except Preempted as stop:
        print(f"Preempted at step {stop.step}: a checkpoint was saved; run the same command with resume=auto "
              "to continue", file=sys.stderr, flush=True)
        sys.exit(stop.code)


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
        if {entry.name for entry in parent.iterdir()} - {"multirun.yaml"}:
            break
        shutil.rmtree(parent, ignore_errors=True)
        parent = parent.parent
