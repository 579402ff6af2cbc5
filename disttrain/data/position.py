"""Where a training epoch stands, counted in global samples, so it reads back on any data-parallel size.

Rank ``r`` of ``R`` reads ``perm[r::R]`` of the epoch's permutation, so after ``j`` samples per rank the ranks
together have read exactly ``perm[:j * R]``, whatever ``R`` is. A position in global samples therefore
continues on ``R'`` ranks by skipping ``samples / R'`` on each: nothing read twice, nothing left out, whatever
micro-batch and accumulation the two runs use. A position in micro-batches of one rank (what checkpoints held
before) is exact only when the micro-batch and the data-parallel size stay the same.
"""

from __future__ import annotations

from typing import Any


def epoch_position(epoch: int, batches: int, micro_size: int, accumulation: int, dp: int) -> dict[str, int]:
    """The position saved with a checkpoint after ``batches`` micro-batches of ``micro_size`` on each of ``dp``
    ranks in ``epoch``, with the layout that read them (a resumed run compares its own with it)."""
    return {"epoch": epoch, "samples": batches * micro_size * dp, "micro_size": micro_size,
            "accumulation": accumulation, "dp": dp}


def samples_done(state: dict[str, Any]) -> int | None:
    """Global samples of the saved epoch already trained on; None for a position that cannot say (a position in
    micro-batches saved without the micro-batch and data-parallel size that read them)."""
    if "samples" in state:
        return int(state["samples"])
    if all(key in state for key in ("batches", "micro_size", "dp")):
        return int(state["batches"]) * int(state["micro_size"]) * int(state["dp"])
    return None


def skip_per_rank(state: dict[str, Any], micro_size: int, dp: int) -> int:
    """Samples each of ``dp`` ranks skips in the resumed epoch.

    Exact whenever ``dp`` divides the samples done, which holds when the global batch is the one the samples
    were read with (``resolve_batch`` makes ``dp`` divide it); after a change of the global batch the ranks
    together re-read fewer than ``dp`` samples. A position without samples keeps its old meaning: that many
    of this run's micro-batches on every rank.
    """
    samples = samples_done(state)
    if samples is None:
        return int(state.get("batches", 0)) * micro_size
    return samples // dp


def batches_done(state: dict[str, Any], micro_size: int, dp: int) -> int | None:
    """Micro-batches of ``micro_size`` each of ``dp`` ranks would have read to reach the saved position (what
    Lightning's epoch loop must count in the resumed epoch); None where the position cannot say."""
    samples = samples_done(state)
    return None if samples is None else samples // (dp * micro_size)
