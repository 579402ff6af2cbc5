"""One replica group's side of a torchft step: the quorum, the gradient mean over the groups that take part,
the vote on committing the step, and what the run records about membership.

The ``torchft.Manager`` is used directly (not torchft's DDP or optimiser wrappers: its DDP hook asserts in every
survivor when a peer dies inside the all-reduce, and its optimiser wrapper refuses Lightning's closures).
The quorum is synchronous: a group that heals at a step takes part in it with its own batch, and the state it
copies is read while the serving rank's main thread waits, so reading Lightning's objects there is safe.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from disttrain.fault.config import FaultToleranceConfig
from disttrain.fault.replica_groups import BEAT_KEY, FAULT_TIME_VAR, JOB_STORE_VAR, LIGHTHOUSE_VAR, beat_value

BEAT_INTERVAL_S = 0.2
"""How often each rank leaves a heartbeat for the job in its group's store."""


class ReplicaSteps:
    """The Manager of this rank's group and the step protocol around it; ``send`` returns this rank's state for
    a restarted group, ``receive`` takes a peer's."""

    def __init__(self, ft: FaultToleranceConfig, group: int, groups: int, samples_per_group: int, log_dir: Path,
                 send: Callable[[], dict[str, Any]], receive: Callable[[dict[str, Any]], None]) -> None:
        self.ft, self.group, self.groups = ft, group, groups
        self.samples_per_group = samples_per_group
        """Samples one group processes in a step (micro-batch x accumulation x its data-parallel ranks)."""
        self.membership = log_dir / "membership.jsonl"
        self.attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.rank = int(os.environ.get("RANK", "0"))
        self._send, self._receive = send, receive
        self.manager: Any = None
        self.quorum_taken = False
        """The quorum of the coming step was already taken (before fit, by a restarted group)."""
        self.healed = False
        """The last quorum copied a peer's state into this group."""
        self.counts = {"steps_committed": 0, "steps_not_committed": 0, "steps_with_fewer_groups": 0,
                       "samples_in_those_steps": 0, "samples_full_steps_would_have": 0}
        """What this group saw (a restarted group continues its source's counts)."""
        self.quorum_s: list[float] = []
        """Seconds each step's quorum took on this rank."""
        self._quorum_id: int | None = None
        self._committed_once = False
        self._beats = threading.Event()
        """Wakes the heartbeat early: a step was committed, or the heartbeat is to stop (``_stopped``)."""
        self._stopped = False

    # ---- the Manager ----
    def start(self) -> None:
        """Create the Manager (rank 0 of the group also starts the group's server, which joins the lighthouse) and
        the heartbeat the job watches; once per process."""
        if self.manager is not None:
            return
        import logging

        from torchft import Manager, ProcessGroupGloo

        logging.getLogger("torchft").setLevel(logging.ERROR)  # its per-quorum warnings would fill every log

        timeout = timedelta(seconds=self.ft.timeout_s)
        pg: Any
        if torch.cuda.is_available():
            from torchft import ProcessGroupNCCL

            pg = ProcessGroupNCCL(timeout=timeout)
        else:
            pg = ProcessGroupGloo(timeout=timeout)
        self.manager = Manager(
            pg=pg, load_state_dict=self._received, state_dict=self._send, min_replica_size=self.ft.min_groups,
            use_async_quorum=False, timeout=timeout, quorum_timeout=timedelta(seconds=self.ft.quorum_timeout_s),
            connect_timeout=timedelta(seconds=self.ft.quorum_timeout_s), replica_id=f"group{self.group}",
            lighthouse_addr=os.environ[LIGHTHOUSE_VAR], init_sync=False,  # every group starts from the same seed
        )
        threading.Thread(target=self._beat, name="disttrain-group-beat", daemon=True).start()
        if self.attempt == 0:
            self._wait_for_groups()

    def _wait_for_groups(self) -> None:
        """On the job's first start, wait until every group's ranks have their Manager, so the first steps run
        with all groups (not with whichever started first); at most ``join_timeout_s``."""
        from torch.distributed import TCPStore

        address = os.environ.get(JOB_STORE_VAR)
        if not address:
            return
        host, port = address.rsplit(":", 1)
        store = TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))
        expected = self.groups * int(os.environ.get("WORLD_SIZE", "1"))
        started = store.add("disttrain/ranks_started", 1)
        deadline = time.monotonic() + self.ft.join_timeout_s
        while started < expected and time.monotonic() < deadline:
            time.sleep(0.05)
            started = store.add("disttrain/ranks_started", 0)

    def _beat(self) -> None:
        """Leave a timestamp and the steps committed so far in the group's store (``beat_value``): a stopped or
        frozen rank stops, and the job replaces its group (a group of one rank has no peer inside it to notice);
        a failed group's last beat tells the job after which step it failed. A commit beats at once."""
        from torch.distributed import TCPStore

        store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         wait_for_workers=False, timeout=timedelta(seconds=30))
        while not self._stopped:
            self._beats.wait(BEAT_INTERVAL_S)
            self._beats.clear()
            try:
                store.set(f"{BEAT_KEY}{self.rank}", beat_value(time.time(), self.step()))
            except Exception:  # noqa: BLE001 - the job is gone or replacing this group; nothing to report to
                return

    def stop(self) -> None:
        """Stop the heartbeat and the Manager's servers."""
        self._stopped = True
        self._beats.set()
        if self.manager is not None:
            self.manager.shutdown(wait=False)

    def _received(self, state: dict[str, Any]) -> None:
        self.healed = True
        self._receive(state)

    # ---- the step ----
    def begin_step(self) -> None:
        """The quorum of the step about to run (a no-op when it was already taken before fit)."""
        if self.quorum_taken:
            self.quorum_taken = False
            return
        self.take_quorum()

    def take_quorum(self) -> None:
        """Join the next step's quorum; a group behind the others copies a live group's state here."""
        self.healed = False
        started = time.perf_counter()
        self.manager.start_quorum()
        self.quorum_s.append(time.perf_counter() - started)
        quorum_id = self.manager._quorum_id  # torchft exposes no public accessor for it
        if quorum_id != self._quorum_id or self.healed:
            self._quorum_id = quorum_id
            self._record({"event": "quorum", "quorum_id": quorum_id, "participants": self.participants,
                          "healed": self.healed})

    @property
    def participants(self) -> int:
        """Groups that take part in the current step."""
        return self.manager.num_participants()

    def average(self, tensors: list[torch.Tensor]) -> None:
        """Replace each tensor by its mean over the groups of this step, in one fp32 all-reduce. Never raises: a
        failed exchange is reported to the Manager, and the step is then not committed."""
        if not tensors:
            return
        try:
            flat = torch.cat([t.reshape(-1).float() for t in tensors])
            self.manager.allreduce(flat).wait()
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()
        except Exception as err:  # noqa: BLE001 - a lost group must not end this one's backward
            self.manager.report_error(err)

    def commit(self, finite: bool) -> bool:
        """The group's vote on the step (False where its numbers are not finite, or any rank saw an error); counts
        the step as committed or not, and with how many groups."""
        if not finite:
            self.manager.report_error(RuntimeError("non-finite loss or gradient norm"))
        committed = bool(self.manager.should_commit())
        if not committed:
            self.counts["steps_not_committed"] += 1
            # a line per group: a group that later heals from a peer takes over the peer's counts
            self._record({"event": "not_committed", "attempted": self.step() + 1})
            return False
        self.counts["steps_committed"] += 1
        self._beats.set()
        if self.participants < self.groups:
            self.counts["steps_with_fewer_groups"] += 1
            self.counts["samples_in_those_steps"] += self.participants * self.samples_per_group
            self.counts["samples_full_steps_would_have"] += self.groups * self.samples_per_group
        if not self._committed_once:
            self._committed_once = True
            fault = os.environ.get(FAULT_TIME_VAR)
            self._record({"event": "first_commit", **({"rejoin_s": round(time.time() - float(fault), 3)}
                                                      if fault else {})})
        return True

    def step(self) -> int:
        """Steps committed so far (the same in every group that committed the last one)."""
        return self.manager.current_step()

    def _record(self, entry: dict[str, Any]) -> None:
        """One line of ``logs/membership.jsonl`` (rank 0 of the group writes; lines are short, appended whole)."""
        if self.rank != 0:
            return
        line = {**entry, "group": self.group, "attempt": self.attempt, "step": self.step(), "time": time.time()}
        with open(self.membership, "a") as out:
            out.write(json.dumps(line) + "\n")
