"""Run a function on N gloo ranks in fresh processes and collect what each rank returns.

``run_on_ranks(fn, world_size, *args)`` starts ``world_size`` processes (forked from the runner's fork
server, which has imported torch, Lightning and disttrain once; one thread each), joins them into a gloo
process group on a free local port, calls ``fn(*args)`` on every rank (``torch.distributed.get_rank()``
tells it which) and returns the ranks' return values in rank order. ``fn`` must be a picklable top-level
function and its return values picklable. If a rank raises, the other ranks are stopped and ``RankError``
is raised with that rank's traceback.
"""

from __future__ import annotations

import os
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from disttrain.launch.fork_server import warm_fork_server
from disttrain.parallel.process_group import free_port


class RankError(RuntimeError):
    """A rank raised, died or timed out; the message holds its traceback."""


def _rank_main(rank: int, world_size: int, port: int, timeout: float, fn: Callable, args: tuple, results) -> None:
    os.environ.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    try:
        # Plain pickle copies tensors into bytes; torch's queue would share them by file descriptor, which
        # the parent cannot open once this process has exited.
        results.put((rank, True, pickle.dumps(fn(*args))))
    except BaseException as exc:  # noqa: BLE001  (every failure is reported to the parent)
        text = traceback.format_exc()
        try:
            pickle.dumps(exc)
        except Exception:  # noqa: BLE001
            exc = None
        results.put((rank, False, (text, exc)))
    finally:
        # the report reaches the parent before the process group is torn down: a teardown that aborts in torch's
        # C++ threads (exit -6) must not take a finished rank's result with it
        results.close()
        results.join_thread()
        dist.destroy_process_group()


def _failure(rank: int, payload: tuple, world_size: int, results, procs: list) -> RankError:
    """The error to raise once ``rank`` has failed: every rank's failure that arrives within a few seconds, the
    cause first. A rank that raises closes its connections, so its peers fail too, often before its own report
    arrives; a rank that died without a report is named with its exit code."""
    failures = {rank: payload}
    deadline = time.monotonic() + 5
    while len(failures) < world_size and time.monotonic() < deadline:
        try:
            other, ok, other_payload = results.get(timeout=0.2)
        except queue.Empty:
            if all(p.exitcode is not None for r, p in enumerate(procs) if r not in failures):
                break
            continue
        if not ok:
            failures[other] = other_payload
    dead = [f"rank {r} exited with code {p.exitcode} without a report" for r, p in enumerate(procs)
            if r not in failures and p.exitcode not in (None, 0)]

    def is_echo(text: str) -> bool:
        return "Connection reset by peer" in text or "Connection closed by peer" in text

    order = sorted(failures, key=lambda r: (is_echo(failures[r][0]), r))
    parts = dead + [f"rank {r} of {world_size} failed:\n{failures[r][0]}" for r in order]
    error = RankError("\n".join(parts))
    error.__cause__ = failures[order[0]][1]
    return error


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120) -> list[Any]:
    """``[fn(*args) on rank 0, ..., on rank world_size - 1]``, each rank in its own gloo process."""
    warm_fork_server()
    ctx = mp.get_context("forkserver")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, timeout, fn, args, results), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    values: dict[int, Any] = {}
    deadline, dead_since = time.monotonic() + timeout, {}
    try:
        while len(values) < world_size:
            try:
                rank, ok, payload = results.get(timeout=0.2)
            except queue.Empty:
                now = time.monotonic()
                if now > deadline:
                    raise RankError(f"ranks {sorted(set(range(world_size)) - set(values))} timed out "
                                    f"after {timeout} s") from None
                for r, p in enumerate(procs):
                    if r not in values and p.exitcode is not None and now - dead_since.setdefault(r, now) > 2:
                        raise RankError(f"rank {r} exited with code {p.exitcode} without a result") from None
                continue
            if not ok:
                raise _failure(rank, payload, world_size, results, procs)
            values[rank] = pickle.loads(payload)  # noqa: S301  (bytes this test's own ranks pickled)
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
    return [values[r] for r in range(world_size)]


def written_bytes() -> int | None:
    """Bytes this process has handed to the kernel's write calls so far, sockets included (Linux ``/proc/self/io``
    wchar), or None where it cannot be read. Per process: tests running beside this one do not add to it, as
    they add to an interface's counters."""
    try:
        for line in open("/proc/self/io").read().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def sent_bytes_during(action: Callable[[], Any]) -> int | None:
    """Bytes all ranks' processes wrote while every rank ran ``action`` (between two barriers; gloo's sends over
    TCP are writes), or None where the counters cannot be read."""
    dist.barrier()
    before = written_bytes()
    action()
    dist.barrier()
    after = written_bytes()
    if before is None or after is None:
        return None
    total = torch.tensor(after - before)
    dist.all_reduce(total)
    return int(total)
