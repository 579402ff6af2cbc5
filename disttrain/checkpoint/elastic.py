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
