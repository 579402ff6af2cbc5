"""The job process: validate the composed config once, make the run directory, then start the ranks.

Lightning's own subprocess launcher re-executes the command line in every rank, which re-expands a Hydra sweep
inside each worker; the job hands its workers the resolved config file instead, and they never re-run Hydra.
Under torchrun or SLURM the ranks already exist: each joins the others and trains in its own process.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from disttrain.config.resolved import RESOLVED_FILE, rank_file
from disttrain.config.typed import parallel_options
from disttrain.config.validation import validate
from disttrain.launch.fork_server import forks_ranks
from disttrain.launch.restart_all import RestartAll
from disttrain.launch.restart_group import RestartGroup
from disttrain.report.results_file import objective_of
from disttrain.report.timing import record_command_start

# The ranks' modules (rank.run, parallel.process_group) import Lightning, seconds of imports: they are imported
# where this process becomes a rank, so that a config error prints before them.

CONFIG_FILE = "config.yaml"
"""In the run directory: the resolved config, for people and tools (the ranks read ``resolved.yaml``)."""
RANK_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")


def train(cfg: DictConfig) -> float | None:
    """Validate ``cfg``, start its ranks, train, test, write the run directory; return the optimised metric.

    Called by ``train.py`` in the Hydra job process. Every check happens here, before any worker starts.
    """
    env = _external_environment()
    if env is not None:  # torchrun / SLURM started every rank, and each of them composed the config
        from disttrain.parallel.process_group import init_process_group
        from disttrain.rank.run import run_rank

        parallel = parallel_options(cfg)
        init_process_group(env, parallel.backend, parallel.timeout_s)
        OmegaConf.update(cfg, "run_dir", str(_agree_on_run_dir(Path(cfg.run_dir))))  # before the one validation
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
    if run.train.mode == "dryrun":
        from disttrain.plan.dryrun import dry_run

        dry_run(run)
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_FILE).write_text(run.yaml)
    resolved_path = run_dir / RESOLVED_FILE  # what the ranks read
    resolved_path.write_text(rank_file(run))
    restarts, forks = run.train.fault_tolerance.max_restarts, forks_ranks(run.train.trainer.rank_start)
    if run.plan.kind == "torchft":  # replica groups: the job runs the lighthouse and restarts groups one by one
        groups = run.layout.dp_replicate
        RestartGroup(groups, run.layout.world_size // groups, resolved_path, run_dir / "logs",
                     run.train.fault_tolerance, forks).run()
        return objective_of(run_dir)
    if run.layout.world_size == 1 and not restarts:  # nothing to supervise: train in this process
        from disttrain.rank.run import run_rank

        with rank_environment(single_rank_environment()):
            return run_rank(run)
    # the job hosts the rendezvous store, shows rank 0's output as its own and restarts failed ranks
    RestartAll(run.layout.world_size, resolved_path, run_dir / "logs", restarts, forks, run.world_sizes).run()
    return objective_of(run_dir)


@contextmanager
def rank_environment(values: dict[str, str]) -> Iterator[None]:
    """Set the rank variables for the duration of one job and restore the previous ones afterwards."""
    saved = {key: os.environ.get(key) for key in RANK_VARIABLES}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _external_environment() -> Any:
    """The cluster environment of a launcher that started the ranks (torchrun, SLURM), else None: Lightning's
    detection (``process_group.external_environment``), asked only where such a launcher's variables are set."""
    if "LOCAL_RANK" not in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) <= 1:
        return None
    from disttrain.parallel.process_group import external_environment

    return external_environment()


def single_rank_environment() -> dict[str, str]:
    """Rank variables of a one-process run (the process group still needs an address)."""
    from disttrain.parallel.process_group import free_port

    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "1", "NODE_RANK": "0",
            "LOCAL_WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}


def _agree_on_run_dir(own: Path) -> Path:
    """Under an external launcher every rank ran Hydra: all adopt rank 0's directory and drop their own (loggers'
    ``save_dir`` interpolates ``${run_dir}``, so they follow when validation resolves the config)."""
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
