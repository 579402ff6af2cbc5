"""The process group of a run's ranks: which launcher started them (torchrun, SLURM, the job process), how many
there are per node, and joining and leaving the group."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import (
    ClusterEnvironment,
    LightningEnvironment,
    SLURMEnvironment,
    TorchElasticEnvironment,
)


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
    """Join the ranks of ``env`` (Lightning then reuses this group instead of creating its own).

    The group's keys live under a prefix of the launcher's restart count: torchrun's agent keeps one store
    across restarts, and a restarted rank could otherwise read a dead rank's address from the attempt before.
    """
    from datetime import timedelta

    from torch.distributed import PrefixStore, TCPStore

    from disttrain.parallel.store import hosted_store

    if dist.is_initialized():
        return
    timeout = timedelta(seconds=timeout_s)
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    if not agent_hosts_store and env.global_rank() == 0:  # on the interface the launcher named, not every one
        store = hosted_store(env.main_address, env.main_port, env.world_size(), timeout, wait_for_workers=True,
                             one_machine=_on_one_machine(env))
    else:
        store = TCPStore(env.main_address, env.main_port, env.world_size(), is_master=False, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend or default_backend(), store=PrefixStore(f"disttrain/attempt{attempt}/", store),
                            rank=env.global_rank(), world_size=env.world_size(), timeout=timeout)


def _on_one_machine(env: ClusterEnvironment) -> bool:
    """Whether the launcher placed every rank on this machine."""
    if int(os.environ.get("SLURM_NNODES", "1")) > 1:
        return False
    return rank_layout(env.world_size(), 1)[1] == 1


def shutdown_process_group() -> None:
    """Destroy the process group: Lightning leaves it alive, which would hang the next job of a sweep."""
    if dist.is_initialized():
        dist.destroy_process_group()
