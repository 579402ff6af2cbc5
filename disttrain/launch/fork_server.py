"""Starting a worker rank: forked from a server process that has imported torch, Lightning and disttrain once.

A fresh interpreter per rank spends seconds importing them (ranks importing side by side share the cores), on
every start and every restart. multiprocessing's fork server imports them once, before any
thread or accelerator context exists, and forks each rank from there in milliseconds; the job process itself
could not be forked safely (its rendezvous store runs threads). A rank receives its environment, working
directory, import path and output descriptors from the job at the moment it starts, as a new process would.
"""

from __future__ import annotations

import multiprocessing
import os
import select
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from multiprocessing import forkserver, reduction, spawn
from pathlib import Path

from disttrain.config.schema import fork_server_available
from disttrain.fault.config import PREEMPTION_SIGNALS

PRELOAD = ["disttrain.launch.gc_paused", "disttrain.rank.run", "sklearn.datasets", "sklearn.model_selection",
           "disttrain.launch.warm_data", "disttrain.launch.schema_nodes", "disttrain.launch.frozen_heap"]
"""What the fork server imports before it forks a rank. First the module that turns the garbage collector off
while the server imports: its full collections walked the growing heap of modules again and again, where one
collection before the heap is frozen now does. Then the worker and, through it, torch and Lightning; what the
default data's split imports where it runs (in every rank of a digits run otherwise, once here) and the data
itself (``warm_data``); the module that builds the config schemas' nodes every rank's validation merges into
(``schema_nodes``). Last, the module that freezes the server's heap for the garbage collector and turns it back
on, which saves every forked rank CPU time (benchmarks/README.md, Figures cited elsewhere)."""


def forks_ranks(rank_start: str) -> bool:
    """Whether ``trainer.rank_start`` means ranks forked from the fork server (auto: where there is one)."""
    return rank_start == "fork_server" or (rank_start == "auto" and fork_server_available())


def warm_fork_server() -> None:
    """Start the fork server now (it is one per job process, reused by every run and restart), so that its
    imports run while the job validates the config and prepares the run."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    try:  # the server ignores the signals the job forwards: were it to die, its ranks' exit statuses were lost
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in PREEMPTION_SIGNALS}
    except ValueError:  # not the main thread: signals cannot be set here, and the server keeps the defaults
        previous = {}
    try:
        with _streams_to_devnull():
            forkserver.ensure_running()  # a process started now inherits the ignored dispositions and streams
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def _streams_to_devnull() -> Iterator[None]:
    """Point this process's stdout and stderr at /dev/null while the fork server starts: every rank gets its
    streams passed explicitly, and a server holding the job's would keep a pipe reading the job's output open
    until the server's own teardown after the job has ended."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    saved = [os.dup(1), os.dup(2)]
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


class ForkedRank:
    """A rank forked by the fork server, with the part of ``subprocess.Popen``'s interface the supervisor uses."""

    def __init__(self, config_path: Path, env: dict[str, str], stdout_fd: int, stderr_fd: int) -> None:
        warm_fork_server()
        context = multiprocessing.get_context("forkserver")
        self._process = context.Process(target=_run_forked, name="disttrain-rank", args=(
            str(config_path), env, os.getcwd(), list(sys.path), _PassedFd(stdout_fd), _PassedFd(stderr_fd),
            os.getpid()))
        with _main_script_left_out():
            self._process.start()

    @property
    def pid(self) -> int | None:
        """The rank's process id."""
        return self._process.pid

    def poll(self) -> int | None:
        """The exit status (negative: the signal that ended it), or None while it runs."""
        return self._process.exitcode

    @property
    def sentinel(self) -> int:
        """A file descriptor that becomes readable when the rank ends (``multiprocessing.connection.wait``)."""
        return self._process.sentinel

    def kill(self) -> None:
        """SIGKILL the rank (if it still runs)."""
        self._process.kill()

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` to the rank (if it still runs)."""
        if self._process.exitcode is None:
            os.kill(self._process.pid, signum)

    def wait(self) -> int | None:
        """Wait for the rank to end; its exit status."""
        self._process.join()
        return self._process.exitcode


@contextmanager
def _main_script_left_out() -> Iterator[None]:
    """multiprocessing imports the job's main script again in a started process, to find functions defined
    there; a rank's body lives in disttrain, and a user's script without a main guard would run again."""
    prepare = spawn.get_preparation_data

    def without_main(name: str) -> dict:
        return {key: value for key, value in prepare(name).items() if not key.startswith("init_main_from")}

    spawn.get_preparation_data = without_main  # looked up at each start, so this covers exactly this one
    try:
        yield
    finally:
        spawn.get_preparation_data = prepare


class _PassedFd:
    """A file descriptor of the job, duplicated into the rank as it starts (multiprocessing sends it along)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(duplicate) -> int:
    return duplicate.detach()


def _run_forked(config_path: str, env: dict[str, str], cwd: str, sys_path: Sequence[str], stdout_fd: int,
                stderr_fd: int, job_pid: int) -> None:
    """The rank's body in the forked process: become what ``python -m disttrain.rank.run CONFIG`` started with
    ``env`` in ``cwd`` would be, then run the worker."""
    _end_with_the_job(job_pid)
    for sig in PREEMPTION_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    for fd, target in ((stdout_fd, 1), (stderr_fd, 2)):
        os.dup2(fd, target)
        os.close(fd)
    for stream in (sys.stdout, sys.stderr):  # line by line on a terminal, as a new interpreter would
        stream.reconfigure(line_buffering=os.isatty(stream.fileno()))
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = [cwd, *(path for path in sys_path if path != cwd)]  # ``python -m`` puts the directory first
    sys.argv = [sys.argv[0], config_path]
    if "OMP_NUM_THREADS" in env:  # torch sizes its thread pool from the variable once; the server imported it
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    from disttrain.rank.run import run_and_exit

    run_and_exit(Path(config_path))


def _end_with_the_job(job_pid: int) -> None:
    """SIGKILL this rank as soon as the job process ``job_pid`` ends (a thread waits on its process descriptor;
    Linux). The job stops its ranks itself whenever it can; a job killed outright (SIGKILL, out of memory) cannot,
    and its ranks would train on unsupervised until their watchdog found the job's store gone, printing torch's C++
    store errors on the terminal the job has left. The fork server, their parent, outlives the job while they run."""
    if not hasattr(os, "pidfd_open"):
        return
    try:
        job = os.pidfd_open(job_pid)
    except OSError:  # ended already, or no process descriptors here
        if not os.path.exists(f"/proc/{job_pid}"):
            os.kill(os.getpid(), signal.SIGKILL)
        return

    def wait() -> None:
        select.select([job], [], [])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait, name="disttrain-job-watch", daemon=True).start()
