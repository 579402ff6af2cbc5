"""A run's checkpoints as sharded folders (``torch.distributed.checkpoint``): written beside the target and
swapped in whole, optionally in the background, and read back into an already parallelised model."""

from __future__ import annotations

import copy
import errno
import itertools
import os
import shutil
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from disttrain.checkpoint.io import METADATA_FILE, load_metadata, load_sharded, one_process
from disttrain.checkpoint.optimizer_state import (
    PACKED_GROUPS,
    load_optimizer_state,
    optimizer_template,
    pack_param_groups,
    unpack_param_groups,
)
from disttrain.errors import SaveFailed


class Ranks(Protocol):
    """What the checkpoints need of the strategy: the ranks' agreement on paths and moments."""

    is_global_zero: bool
    global_rank: int
    world_size: int

    def barrier(self, name: str | None = None) -> None:
        """Wait for every rank."""
        ...

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Rank 0's ``obj`` on every rank."""
        ...


@dataclass(frozen=True)
class SameStateAs:
    """A save's storage option: its model and optimiser state are those of ``folder``, a checkpoint completed at the
    same save point (the ranked ``step<N>.ckpt`` of the step ``last.ckpt`` is written at). Its shards and index are
    then linked from there, and only the small metadata is written."""

    folder: str
    """The complete checkpoint folder whose shards hold this save's state."""


_PLAN_KEYS = itertools.count()
"""Numbers the ``ShardedCheckpoints`` of this process, in the same order on every rank."""
_PLAN_CACHES = ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata",
                "_cached_final_save_plan")
"""torch's class-level caches of save plans, each keyed by a planner's ``_cached_plans_key``."""


def forget_save_plans(key: str) -> None:
    """Drop the save plans cached under ``key`` (a finished Trainer's checkpoints save no more)."""
    from torch.distributed.checkpoint.planner import SavePlanner

    for name in _PLAN_CACHES:
        getattr(SavePlanner, name, {}).pop(key, None)


class ShardedCheckpoints:
    """Saves and loads the checkpoints of one Trainer. ``per_replica``: data-parallel replicas hold different
    parameters between exchanges (Local SGD, DiLoCo, an asynchronous parameter server), so each rank's state is
    kept under its own key; ``async_save``: shards are staged in memory and written in the background."""

    def __init__(self, ranks: Ranks, async_save: bool = False, per_replica: bool = False) -> None:
        self.ranks = ranks
        """The strategy, for barriers and broadcasts."""
        self.async_save = async_save
        """Write in the background (one save in flight)."""
        self.per_replica = per_replica
        """Each rank's state under its own key."""
        self.saves = 0
        """Checkpoints this process saved."""
        self.blocking_s = 0.0
        """Seconds training waited for them (staging only, when saving asynchronously)."""
        self._pending: tuple[Any, Path, Path] | None = None
        self._group: Any = None
        self._plan_key = f"disttrain-checkpoints-{next(_PLAN_KEYS)}"
        weakref.finalize(self, forget_save_plans, self._plan_key)

    def _save_planner(self) -> Any:
        """torch's save planner with its plan cached for these checkpoints alone: the plan is the same at every save
        of a run, so the planning collective runs once. torch keys the cache by the planner's class and reuses a
        cached plan whose tensors have the same shapes, whatever their dtypes, so a shared key would let a later
        run in this process (a sweep's next job: same shapes, another dtype) write an earlier run's metadata."""
        from torch.distributed.checkpoint import DefaultSavePlanner

        planner = DefaultSavePlanner(enable_plan_caching=True)
        planner._cached_plans_key = self._plan_key  # torch takes no argument for the key
        return planner

    def save(self, checkpoint: dict[str, Any], filepath: Any, same_state_as: SameStateAs | None = None) -> None:
        """Write a sharded checkpoint folder beside the target, then swap it in, so a crash mid-write never
        damages the previous checkpoint at ``filepath``. Asynchronously, the swap happens when the next save
        begins or fit ends (``wait``). ``same_state_as``: the shards are already on disk there (see
        ``SameStateAs``); they are hard-linked, never rewritten."""
        started = time.perf_counter()
        ranks = self.ranks
        path = Path(ranks.broadcast(str(filepath)))
        self.wait()  # one save in flight
        staging = path.with_name(path.name + ".partial")
        if ranks.is_global_zero:
            if staging.exists():
                shutil.rmtree(staging)
            staging.mkdir(parents=True)
        ranks.barrier()
        optimizers = checkpoint.pop("optimizer_states", [])
        model_state = checkpoint.pop("state_dict")  # empty where the state is linked
        checkpoint[PACKED_GROUPS] = True
        if self.per_replica:
            checkpoint["replicas"] = ranks.world_size
        try:
            if ranks.is_global_zero:
                torch.save(checkpoint, staging / METADATA_FILE)  # loop, callback and scheduler state: small
            if same_state_as is not None:  # wait() above has swapped the source in, complete
                if ranks.is_global_zero:
                    link_shards(Path(same_state_as.folder), staging)
                self._swap_in(staging, path)
            else:
                self._write_shards(model_state, optimizers, staging, path)
        except Exception as err:
            raise save_failed(err, staging, checkpoint.get("global_step")) from err
        self.saves += 1
        self.blocking_s += time.perf_counter() - started

    def _write_shards(self, model_state: dict[str, Any], optimizers: list[dict[str, Any]], staging: Path,
                      path: Path) -> None:
        """Write this rank's shards of the model and optimiser state into ``staging`` (in the background where
        saves are asynchronous) and swap it in at ``path`` once complete."""
        import torch.distributed.checkpoint as dcp

        shards = {"state_dict": model_state,
                  **{f"optimizer_{i}": pack_param_groups(state) for i, state in enumerate(optimizers)}}
        if self.per_replica:
            shards = {f"replica{self.ranks.global_rank}": shards}
        alone = one_process()
        if self.async_save:
            if self._group is None and not alone:  # its own group: background writes never interleave with training's
                self._group = torch.distributed.new_group(backend="gloo")
            future = dcp.async_save(shards, checkpoint_id=staging, process_group=self._group, no_dist=alone,
                                    planner=self._save_planner())
            self._pending = (future, staging, path)
        else:
            # a later save sends no plan where its own is unchanged (benchmarks/README.md, Figures cited elsewhere)
            dcp.save(shards, checkpoint_id=staging, no_dist=alone, planner=self._save_planner())
            self._swap_in(staging, path)

    def wait(self) -> None:
        """Finish the save in flight, if any, and swap it into place (every rank calls this at the same point)."""
        if self._pending is None:
            return
        future, staging, path = self._pending
        self._pending = None
        try:
            future.result()
            self._swap_in(staging, path)
        except Exception as err:
            raise save_failed(err, staging, None) from err

    def _swap_in(self, staging: Path, path: Path) -> None:
        ranks = self.ranks
        ranks.barrier()
        if ranks.is_global_zero:
            retired = path.with_name(path.name + ".old")
            if path.exists():
                path.rename(retired)
            staging.rename(path)
            if retired.exists():
                shutil.rmtree(retired) if retired.is_dir() else retired.unlink()
        ranks.barrier()

    def load(self, checkpoint_path: Any, model: nn.Module, optimizers: list[Any]) -> dict[str, Any]:
        """Load model and optimiser shards into the already-parallelised ``model`` (any world size); returns the
        checkpoint's small metadata (loop, callback and scheduler state)."""
        path = Path(self.ranks.broadcast(str(checkpoint_path)))
        metadata = load_metadata(path)
        count_steps_in_both_loops(metadata)
        state: dict[str, Any] = {"state_dict": get_model_state_dict(model)}
        packed_keys: list[set[str]] = []
        for idx, optimizer in enumerate(optimizers):
            template = optimizer_template(model, optimizer)
            # packed as saved: checkpoints written before the mark hold each hyper-parameter apart, and load so
            if metadata.get(PACKED_GROUPS):
                flat_keys, template = set(template), pack_param_groups(template)
                packed_keys.append(set(template) - flat_keys)
            else:
                packed_keys.append(set())
            state[f"optimizer_{idx}"] = template
        if self.per_replica:
            load_sharded({f"replica{self.ranks.global_rank % metadata.get('replicas', 1)}": state}, path)
        else:
            load_sharded(state, path)
        set_model_state_dict(model, state["state_dict"])
        for idx, optimizer in enumerate(optimizers):
            loaded = unpack_param_groups(state[f"optimizer_{idx}"], packed_keys[idx])
            load_optimizer_state(model, optimizer, loaded)
        return metadata


def link_shards(source: Path, staging: Path) -> None:
    """Hard-link every file of the checkpoint folder ``source`` but its metadata into ``staging`` (copied where
    the file system has no hard links). A checkpoint's files are written once and never changed in place, so the
    two folders share them safely, and either may be deleted or retired without touching the other."""

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, staging, copy_function=link_or_copy, dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns(METADATA_FILE))


def count_steps_in_both_loops(metadata: dict[str, Any]) -> None:
    """Give Lightning's automatic and manual optimisation loops the same count of optimiser steps.

    A checkpoint counts its steps only in the loop that took them (manual: pipeline stages and federated rounds,
    which step by hand; automatic: every other layout), and the global step is read from the loop of the run
    that resumes: without this, a pipelined checkpoint resumed without stages would start again at step 0.
    """
    fit = metadata.get("loops", {}).get("fit_loop", {})
    automatic = fit.get("epoch_loop.automatic_optimization.optim_progress")
    manual = fit.get("epoch_loop.manual_optimization.optim_step_progress")
    if automatic is None or manual is None:
        return
    step = automatic["optimizer"]["step"]
    if step["total"]["completed"] < manual["total"]["completed"]:
        automatic["optimizer"]["step"] = copy.deepcopy(manual)
        automatic["optimizer"]["zero_grad"] = {
            part: {**counts, "started": counts["completed"]} for part, counts in manual.items()}
    elif manual["total"]["completed"] < step["total"]["completed"]:
        fit["epoch_loop.manual_optimization.optim_step_progress"] = copy.deepcopy(step)


def disk_full(err: BaseException, folder: Path) -> str | None:
    """``the disk is full (N KiB free on folder)`` where ``err`` (or what it wraps: a chained error, or a rank's
    failure gathered by torch.distributed.checkpoint) is a full disk or quota, or almost nothing is left; None
    otherwise. torch.save reports a failed write as an unchained RuntimeError, so the free space decides too."""
    seen, pending = set(), [err]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            break
        pending += [current.__cause__, current.__context__,
                    *(failure[0] for failure in getattr(current, "failures", {}).values())]
    else:
        try:
            if shutil.disk_usage(folder).free >= FULL_BELOW:
                return None
        except OSError:
            return None
    try:
        free = f"{shutil.disk_usage(folder).free // 1024} KiB free on {folder}"
    except OSError:
        free = f"on {folder}"
    return f"the disk is full ({free})"


FULL_BELOW = 1 << 20
"""Free bytes under which a failed save is put down to a full disk."""


def save_failed(err: BaseException, staging: Path, step: int | None) -> SaveFailed:
    """The one-line stop for a checkpoint that could not be written: its partial folder removed (every rank that
    failed tries; it held nothing usable and may hold the disk), and the last good checkpoint named."""
    from disttrain.checkpoint.folders import newest_complete, saved_step

    why = disk_full(err, staging.parent) or (str(err).strip().splitlines() or [type(err).__name__])[0]
    shutil.rmtree(staging, ignore_errors=True)
    at = f" at step {step}" if step is not None else ""
    newest, _ = newest_complete(staging.parent)
    kept = (f"the last good checkpoint is {newest} (step {saved_step(newest)})" if newest is not None
            else "no complete checkpoint was saved before it")
    return SaveFailed(f"checkpoint {staging.name.removesuffix('.partial')}{at} could not be written: {why}; its "
                      f"partial folder was removed and {kept}")
