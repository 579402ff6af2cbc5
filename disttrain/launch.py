"""Starting ranks: the job process owns the run and starts plain-Python workers that never re-run Hydra.

Lightning's own subprocess launcher re-executes the command line in every rank, which re-expands a Hydra
sweep inside each worker; this launcher hands workers the resolved config file instead. Under torchrun or
SLURM the ranks already exist, and this module only joins them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import (
    ClusterEnvironment,
    LightningEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)

T = TypeVar("T")
RANK_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")


class WorkerError(RuntimeError):
    """A worker rank failed; the message carries the end of its log."""


def external_environment() -> ClusterEnvironment | None:
    """The cluster environment of a launcher that started the ranks itself (torchrun, SLURM), else None."""
    if TorchElasticEnvironment.detect():
        return TorchElasticEnvironment()
    if SLURMEnvironment.detect() and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return SLURMEnvironment()
    if "LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return LightningEnvironment()
    return None


def rank_layout(devices: int, num_nodes: int) -> tuple[int, int]:
    """(ranks per node, nodes): the launcher's when it started the ranks, else the config's."""
    env = external_environment()
    if env is None:
        return devices, num_nodes
    world = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else env.world_size()
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or world)
    return per_node, max(1, world // per_node)


def free_port() -> int:
    """An unused TCP port on this machine for the rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def default_backend() -> str:
    """gloo for CPU tensors, and NCCL for CUDA tensors when a GPU is present."""
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(env: ClusterEnvironment, backend: str | None, timeout_s: int) -> None:
    """Join the ranks of ``env`` (Lightning then reuses this group instead of creating its own)."""
    from datetime import timedelta

    if dist.is_initialized():
        return
    dist.init_process_group(
        backend or default_backend(),
        init_method=f"tcp://{env.main_address}:{env.main_port}",
        rank=env.global_rank(),
        world_size=env.world_size(),
        timeout=timedelta(seconds=timeout_s),
    )


def shutdown_process_group() -> None:
    """Destroy the process group: Lightning leaves it alive, which would hang the next job of a sweep."""
    if dist.is_initialized():
        dist.destroy_process_group()


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


def spawn_and_run(world_size: int, config_path: Path, log_dir: Path, rank0: Callable[[], T]) -> T:
    """Start ranks 1..N-1 as workers reading ``config_path``, run rank 0 here, and reap the workers.

    A failing worker surfaces here as a WorkerError with the end of its log; a failing rank 0 stops the
    workers instead of leaving them waiting in a collective.
    """
    port = str(free_port())
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(world_size), "NODE_RANK": "0",
            "LOCAL_WORLD_SIZE": str(world_size)}
    log_dir.mkdir(parents=True, exist_ok=True)
    workers: list[tuple[int, subprocess.Popen, Path]] = []
    for rank in range(1, world_size):
        log_path = log_dir / f"rank{rank}.log"
        env = {**os.environ, **base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "disttrain.worker", str(config_path)],
                env=env, stdout=log, stderr=subprocess.STDOUT,
            )
        workers.append((rank, proc, log_path))
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(workers, stop), daemon=True)
    watcher.start()
    try:
        with rank_environment({**base, "RANK": "0", "LOCAL_RANK": "0"}):
            result = rank0()
    except BaseException as err:
        stop.set()
        _stop(workers)
        failure = _first_failure(workers)
        if failure is not None:
            raise failure from err
        raise
    stop.set()
    for rank, proc, log_path in workers:
        if proc.wait() != 0:
            raise _worker_error(rank, proc.returncode, log_path)
    return result


def _watch(workers: list[tuple[int, subprocess.Popen, Path]], stop: threading.Event) -> None:
    """Poll the workers; when one dies with an error, interrupt rank 0 rather than letting it hang."""
    import _thread

    while not stop.wait(0.5):
        if any(proc.poll() not in (None, 0) for _, proc, _ in workers):
            _thread.interrupt_main()
            return


def _stop(workers: list[tuple[int, subprocess.Popen, Path]]) -> None:
    for _, proc, _ in workers:
        if proc.poll() is None:
            proc.terminate()
    for _, proc, _ in workers:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _first_failure(workers: list[tuple[int, subprocess.Popen, Path]]) -> WorkerError | None:
    for rank, proc, log_path in workers:
        if proc.returncode not in (None, 0, -15):
            return _worker_error(rank, proc.returncode, log_path)
    return None


def _worker_error(rank: int, code: int, log_path: Path) -> WorkerError:
    tail = log_path.read_text(errors="replace").strip().splitlines()[-15:] if log_path.exists() else []
    return WorkerError(f"rank {rank} exited with code {code}; end of {log_path}:\n" + "\n".join(tail))
