"""A checkpoint's loop counters moved to another accumulation, so that a run resumed on another data-parallel
size closes its accumulation windows where they belong.

Lightning counts the epoch loop's progress in micro-batches of one rank and ends an accumulation window when
``batch_progress.current.ready % accumulate_grad_batches == 0`` (a pipelined task asks the same of its batch
index). With the global batch kept, a change of data-parallel size changes the micro-batches per step; the
restored counts must then be those of the new layout, or the first window after the resume closes early or
late and the step averages the wrong number of micro-batches. Optimiser steps, the scheduler and the global
step count steps and are left as they are.
"""

from __future__ import annotations

from typing import Any

COUNTERS = ("ready", "started", "processed", "completed")
"""The stages of Lightning's progress counters (each at most one behind the one before)."""


def rewrite_batch_progress(fit_loop: dict[str, Any], batches_now: int, per_step_before: int,
                           per_step_now: int) -> bool:
    """Rewrite the epoch loop's ``batch_progress`` in ``fit_loop`` (a checkpoint's ``loops["fit_loop"]``) to
    micro-batches of the resuming run; False where the checkpoint has none.

    ``batches_now``: micro-batches of the resuming run that reach the saved position in the current epoch
    (``disttrain.data.position.batches_done``). Finished epochs held whole optimiser steps of
    ``per_step_before`` micro-batches each and count ``per_step_now`` each after the rewrite. Each stage keeps
    its distance from ``processed`` (a save at the end of a batch is recorded with ``completed`` one behind, and
    Lightning reads that gap to know where it stopped).
    """
    progress = fit_loop.get("epoch_loop.batch_progress")
    if not progress:
        return False
    current, total = progress["current"], progress["total"]
    earlier = total["processed"] - current["processed"]  # micro-batches of the finished epochs
    total_now = earlier // per_step_before * per_step_now + batches_now
    for counts, now in ((current, batches_now), (total, total_now)):
        base = counts["processed"]
        for stage in COUNTERS:
            counts[stage] = now + counts[stage] - base
    return True


def reopen_cut_epoch(fit_loop: dict[str, Any], position: dict[str, Any]) -> bool:
    """Make a checkpoint saved as a fit stopped at ``max_steps`` in the middle of an epoch read as the mid-epoch
    save point it is (``fit_loop``: its ``loops["fit_loop"]``; ``position``: its data module's state, rewritten
    in place too); False where it already does.

    Once ``max_steps`` ends the epoch loop, Lightning counts the running epoch as processed, then as completed,
    and a save at that moment (the end of the fit) records it so: a run resumed from it with more steps took
    the epoch as finished and started the next (or stopped, where that was the last), skipping the epoch's
    rest, and after the count the data position named the next epoch. A save point inside an epoch has the
    epoch started but neither processed nor completed, and its batch completed one behind processed.
    """
    epochs = fit_loop.get("epoch_progress")
    batches = fit_loop.get("epoch_loop.batch_progress")
    if not epochs or not batches or batches.get("is_last_batch") or not batches["current"]["processed"]:
        return False
    if epochs["current"]["processed"] < epochs["current"]["ready"]:  # a save point inside the epoch already
        return False
    for part in ("current", "total"):
        epochs[part]["processed"] = epochs[part]["completed"] = epochs[part]["ready"] - 1
        if batches[part]["completed"] == batches[part]["processed"]:
            batches[part]["completed"] -= 1
    if "epoch" in position:
        position["epoch"] = epochs["current"]["ready"] - 1
    return True
