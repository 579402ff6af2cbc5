"""One job per run directory: the job that owns a directory holds an OS lock on a file in it while it lives.

Two jobs writing into one directory (the same ``hydra.run.dir``, or two sweeps with one ``hydra.sweep.dir``)
would mix their configs, metrics and checkpoints. The owner takes ``flock`` on ``.lock`` before anything is
written there; the kernel drops the lock when the owner's process ends, however it ends, so a later job may
continue the directory (``resume=auto``, a requeued SLURM job, a torchrun restart). A second job is refused in
one line while the first runs. The lock file's descriptor is not inherited by the ranks a job starts (a new
interpreter or the fork server's children), so it is held by the job's process alone.

Under torchrun or SLURM every rank runs Hydra: global rank 0 holds the lock for the job and the other ranks
share its directory (``job._agree_on_run_dir``).
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from disttrain.errors import ConfigError

LOCK_FILE = ".lock"
"""In a run (or sweep) directory: locked by the job that owns it; it names that job's process and host."""

_held: dict[Path, int] = {}
"""The directories this process holds, by resolved path, and the lock file's descriptor of each."""


def owns_run_dir() -> bool:
    """Whether this process owns its job's run directory: a job process, or global rank 0 where a launcher
    (torchrun, SLURM) started every rank and each of them ran Hydra."""
    if "LOCAL_RANK" in os.environ:
        return os.environ.get("RANK", "0") == "0"
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        return os.environ.get("SLURM_PROCID", "0") == "0"
    return True


def hold(run_dir: str | Path, key: str) -> Path | None:
    """Create ``run_dir`` and lock it for this process until :func:`release` or the process's end; the resolved
    directory, or None where this process holds it (or a directory above it) already or does not own it.

    ``key`` (``hydra.run.dir``, ``hydra.sweep.dir``) names the setting in the ConfigError raised when another
    job holds the directory, or when it cannot be created or written (a read-only file system, a path under a
    file, no permission)."""
    try:
        path = Path(run_dir).absolute()
        path.mkdir(parents=True, exist_ok=True)  # every rank needs it; only the owner locks it
        if not owns_run_dir():
            return None
        path = path.resolve()
        if any(folder in _held for folder in (path, *path.parents)):
            return None
        fd = _lock(path, key, run_dir)
    except OSError as err:
        raise ConfigError(key, str(run_dir), f"a directory this job can create and write; {err}") from None
    _held[path] = -1 if fd is None else fd  # -1: held without a lock, and said so once
    return path


def hold_or_exit(run_dir: str | Path, key: str) -> Path | None:
    """:func:`hold`, or its refusal as one ``Error:`` line and exit status 2. No exception: Hydra turns a
    callback's exception into a warning and goes on, and a refusal is no bug to trace (``HYDRA_FULL_ERROR=1``
    changes nothing here)."""
    try:
        return hold(run_dir, key)
    except ConfigError as err:
        print(f"Error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)


def release(path: Path | None) -> None:
    """Let go of a directory that :func:`hold` returned (nothing for None or one not held)."""
    fd = _held.pop(path, -1) if path is not None else -1
    if fd >= 0:
        os.close(fd)  # closing the only descriptor of the lock file drops the lock


def release_all() -> None:
    """Let go of every directory this process holds (a job's end in a process that runs more after it)."""
    for path in list(_held):
        release(path)


def _lock(path: Path, key: str, given: str | Path) -> int | None:
    """The descriptor of ``path``'s lock file, locked; None where its file system has no locks."""
    for _ in range(3):
        fd = os.open(path / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            owner = os.pread(fd, 200, 0).decode(errors="replace").strip()
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                print(f"disttrain: {key}={given}: its file system cannot lock {LOCK_FILE} ({err.strerror}); a second "
                      "job started in this directory would not be refused", file=sys.stderr, flush=True)
                return None
            who = f" ({owner})" if owner else ""
            raise ConfigError(key, str(given), f"a directory no other job is running in; another job{who} holds "
                              f"it: choose another {key}, or wait for that job to end (resume=auto continues it "
                              "then)") from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path / LOCK_FILE))
        except FileNotFoundError:  # the job that held it removed the directory (its config was refused)
            same = False
        if same:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"process {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
            return fd
        os.close(fd)
        path.mkdir(parents=True, exist_ok=True)
    raise OSError(errno.EAGAIN, f"{path / LOCK_FILE} was removed while it was being locked")


def refuse_an_earlier_run(path: Path, given: str, config: DictConfig) -> None:
    """One ``Error:`` line and exit status 2 where ``path`` holds an earlier run (its ``config.yaml``) and this
    training job would start afresh over it: its metrics and checkpoints would mix with the earlier run's, and
    Lightning would number the new save points past the ones ``resume=auto`` reads. A job that continues the run
    (``resume``, or a launcher's restart) is what the directory is for."""
    from disttrain.fault.config import restart_count
    from disttrain.launch.job import CONFIG_FILE  # what a run writes into its directory first

    if not (path / CONFIG_FILE).is_file() or OmegaConf.select(config, "resume") is not None \
            or OmegaConf.select(config, "mode", default="train") != "train" or restart_count():
        return
    refusal = ConfigError("hydra.run.dir", given, f"a directory without a run, where resume is null; it holds an "
                          f"earlier run (its {CONFIG_FILE}): resume=auto continues that run, or choose another "
                          "hydra.run.dir")
    print(f"Error: {refusal}", file=sys.stderr, flush=True)
    sys.exit(2)


def configured_dir(config: DictConfig, key: str) -> str:
    """``key`` of Hydra's composed ``config`` as the job will resolve it (``${hydra:...}`` included)."""
    from hydra.core.hydra_config import HydraConfig

    instance = HydraConfig.instance()
    saved = instance.cfg
    instance.set_config(config)  # as Hydra's run_job does first; put back, as it puts back its own
    try:
        return str(OmegaConf.select(config, key))
    finally:
        instance.cfg = saved


class RunDirLock(Callback):
    """Hydra callback (``hydra.callbacks.run_dir_lock``): lock the run directory, or a sweep's directory, before
    Hydra creates it and writes its ``.hydra/`` record there, and let go when the run or sweep ends."""

    def __init__(self) -> None:
        self._held: Path | None = None

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Before Hydra makes the job's directory."""
        run_dir = configured_dir(config, "hydra.run.dir")
        self._held = hold_or_exit(run_dir, "hydra.run.dir")
        if self._held is not None:
            refuse_an_earlier_run(self._held, run_dir, config)

    def on_run_end(self, config: DictConfig, **kwargs: Any) -> None:
        """After the job (also one that failed)."""
        release(self._held)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        """Before the sweeper makes the sweep's directory; its jobs' directories are inside it."""
        self._held = hold_or_exit(configured_dir(config, "hydra.sweep.dir"), "hydra.sweep.dir")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """After the sweep."""
        release(self._held)
