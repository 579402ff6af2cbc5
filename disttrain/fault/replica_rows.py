"""The rows of the run's CSV file that group 0 could not write.

Group 0 alone writes the loggers' rows (every group logs the same numbers). While it is down, stopped or being
restarted, the other groups train on, and their steps' rows would be lost: each other group therefore keeps its
own CSV file, ``logs/group<g>/metrics.csv``, and at the end the group that writes results adds to the run's file
the rows that only those files hold.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

SHADOW_NAME = "group{group}"
"""A group's own CSV folder under the run's ``logs`` folder (beside its ranks' logs)."""
ROW_KINDS = ("train/loss", "train/loss_epoch", "val/", "test/")
"""A column, or a prefix, that names what a row is (a step's, an epoch's end, a validation's, a test's); a row of
none of these is known by all of its columns."""
POSITION_KEYS = ("epoch", "step")
"""Columns that place a row rather than say what it holds."""


def csv_file(logger: dict[str, Any]) -> Path | None:
    """The ``metrics.csv`` that the run's CSV logger writes, if ``logger`` (the ``logger`` group) has one with a
    folder of its own (a string ``version``)."""
    for node in logger.values():
        if node and str(node.get("_target_", "")).endswith(".CSVLogger") and isinstance(node.get("version"), str):
            return Path(str(node["save_dir"])) / str(node.get("name") or "") / node["version"] / "metrics.csv"
    return None


def job_loggers(resolved_yaml: str) -> dict[str, Any]:
    """The job's ``logger`` group, from its resolved config (a group other than 0 runs with its shadow's)."""
    from omegaconf import OmegaConf

    node = OmegaConf.create(resolved_yaml).get("logger")
    return OmegaConf.to_container(node, resolve=True) if node is not None else {}  # type: ignore[return-value]


def shadow_logger(logger: dict[str, Any], run_dir: str, group: int) -> dict[str, Any]:
    """The ``logger`` group of replica group ``group`` (not 0): a CSV logger writing to its own file where the run
    has a CSV file, else none."""
    if group == 0 or csv_file(logger) is None:
        return {}
    return {"csv": {"_target_": "disttrain.rank.loggers.CSVLogger", "save_dir": str(Path(run_dir) / "logs"),
                    "name": SHADOW_NAME.format(group=group), "version": ""}}


def _kind(row: dict[str, str]) -> tuple[int, tuple[str, ...]]:
    """A row's step and what it is (``ROW_KINDS``): the groups log the same rows, though not always the same
    columns in them (a restarted group's first row has no throughput yet)."""
    filled = sorted(k for k, v in row.items() if v not in ("", None) and k not in POSITION_KEYS)
    for kind in ROW_KINDS:
        if any(k == kind or (kind.endswith("/") and k.startswith(kind)) for k in filled):
            return int(float(row["step"])), (kind,)
    return int(float(row["step"])), tuple(filled)


def fill_missing_rows(target: Path, shadows: list[Path]) -> int:
    """Add to ``target`` each row of ``shadows`` whose step and kind it lacks, in step order (a row it has stays
    as it is); returns the number of rows added."""
    if not target.is_file():
        return 0
    with open(target, newline="") as handle:
        reader = csv.DictReader(handle)
        columns, rows = list(reader.fieldnames or []), list(reader)
    have = {_kind(row) for row in rows}
    added = []
    for shadow in shadows:
        if not shadow.is_file():
            continue
        with open(shadow, newline="") as handle:
            reader = csv.DictReader(handle)
            for row in reader:
                if row.get("step") and _kind(row) not in have:
                    have.add(_kind(row))
                    added.append(row)
            columns += [c for c in reader.fieldnames or [] if c not in columns]
    if not added:
        return 0
    merged = sorted(rows + added, key=lambda row: int(float(row["step"])))  # stable: a step's rows keep their order
    partial = target.with_name(target.name + ".partial")
    with open(partial, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(merged)
    partial.replace(target)
    return len(added)
