"""Checkpoint folders: which one a resumed or restarted run continues from (the newest complete one), and the
save points kept beside it.

A checkpoint folder is written as ``<name>.partial`` and renamed when every rank's shards and the index
are on disk, so a folder without the suffix was complete once; a file truncated or lost since (a full
disk, a copy cut short) is caught here by comparing each shard's size with the extents the index
records, and such a folder is skipped, with a warning, for the one before it. A resumed run moves a skipped
folder aside (``<name>.damaged``), so that its new save points take the names that the next resume reads.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from disttrain.checkpoint.io import (
    INDEX_FILE,
    METADATA_FILE,
    CheckpointReadError,
    check_shards,
    load_index,
    load_metadata,
)

RETIRED = re.compile(r"^last-step(\d+)\.ckpt$")
"""Earlier save points kept by ``checkpoint.keep_last``."""


def damage(folder: Path) -> str | None:
    """Why ``folder`` cannot be resumed from (a missing, refused or short file), or None. Reads the metadata and the
    index, and the shards' sizes, not their tensors."""
    try:
        for name in (METADATA_FILE, INDEX_FILE):
            if not (folder / name).is_file():
                raise CheckpointReadError(folder, f"its {name} is missing")
        load_metadata(folder)
        check_shards(folder, load_index(folder))
    except CheckpointReadError as err:
        return err.cause
    except OSError as err:  # moved or removed while we looked
        return f"cannot be read ({err.strerror or err})"
    return None


def saved_step(folder: Path) -> int:
    """The global step a checkpoint folder holds (-1 when its metadata cannot be read)."""
    try:
        return int(load_metadata(folder).get("global_step", -1))
    except Exception:  # noqa: BLE001
        return -1


def newest_complete(checkpoints: Path) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete checkpoint in ``checkpoints`` (``last.ckpt``, the earlier save points kept, and a
    ``last.ckpt.old`` left by a crash mid-swap), and each newer folder that was skipped with its damage."""
    if not checkpoints.is_dir():
        return None, []
    names = [p for p in checkpoints.iterdir() if p.is_dir() and (
        p.name in ("last.ckpt", "last.ckpt.old") or RETIRED.match(p.name))]
    # newest first; at equal steps prefer last.ckpt (the swap had completed)
    ordered = sorted(names, key=lambda p: (saved_step(p), p.name == "last.ckpt"), reverse=True)
    skipped = []
    for folder in ordered:
        problem = damage(folder)
        if problem is None:
            return folder, skipped
        skipped.append((folder, problem))
    return None, skipped


def move_aside(folder: Path) -> Path:
    """Rename a damaged checkpoint folder to the first free ``<name>.damaged[-N]`` beside it (kept, not
    deleted: what it still holds may be worth a look); the new name."""
    target, n = folder.with_name(f"{folder.name}.damaged"), 1
    while target.exists():
        n += 1
        target = folder.with_name(f"{folder.name}.damaged-{n}")
    folder.rename(target)
    return target


def retire_and_prune(checkpoints: Path, keep_last: int) -> None:
    """Before ``last.ckpt`` is replaced: keep it as ``last-step<N>.ckpt`` when ``keep_last`` > 1, and delete
    the retired ones beyond the newest ``keep_last - 1``."""
    import shutil

    last = checkpoints / "last.ckpt"
    if keep_last > 1 and last.is_dir() and damage(last) is None:
        last.rename(checkpoints / f"last-step{saved_step(last)}.ckpt")
    retired = sorted((p for p in checkpoints.glob("last-step*.ckpt") if RETIRED.match(p.name)),
                     key=lambda p: int(RETIRED.match(p.name).group(1)), reverse=True)  # type: ignore[union-attr]
    for old in retired[max(0, keep_last - 1):]:
        shutil.rmtree(old, ignore_errors=True)


def resume_path(resume: str | None, run_dir: Path, announce: bool = True) -> str | None:
    """The checkpoint to continue from: none, the run directory's newest complete one (auto), or a given path.
    ``announce`` (one process of the run: rank 0): print which damaged checkpoints were skipped and move them
    aside, so that this run's save points are written under the names a later ``resume=auto`` reads (Lightning
    numbers a save point ``last-v1.ckpt`` where ``last.ckpt`` exists and is not its own)."""
    if resume is None:
        return None
    if resume == "auto":
        newest, skipped = newest_complete(run_dir / "checkpoints")
        if announce:
            for folder, problem in skipped:
                try:
                    aside = f"; moved aside to {move_aside(folder).name}"
                except OSError as err:
                    aside = f"; could not move it aside ({err.strerror})"
                print(f"disttrain: skipping checkpoint {folder}: {problem}{aside}", file=sys.stderr, flush=True)
            if newest is None:
                print(f"disttrain: resume=auto found no complete checkpoint in {run_dir / 'checkpoints'}: starting "
                      "from step 0", file=sys.stderr, flush=True)
        return str(newest) if newest is not None else None
    return resume
