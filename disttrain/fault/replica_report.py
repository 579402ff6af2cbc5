"""What a run with torchft replica groups records: ``results.json``'s ``fault_tolerance`` section and its one
summary line, from this group's counts, the job's restart records and ``logs/membership.jsonl``."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from disttrain.fault.config import RESTARTS_FILE, FaultToleranceConfig
from disttrain.fault.replica_groups import MEMBERSHIP_FILE


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of ``path`` (none where it does not exist; a line cut short by a kill is skipped)."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def group_restarts(log_dir: Path) -> list[dict[str, Any]]:
    """Each restart of a group: its cause, the steps it had committed when it failed, and when (step, seconds
    after the fault) the new group first committed a step."""
    path = log_dir / RESTARTS_FILE
    failures = json.loads(path.read_text()) if path.is_file() else []
    firsts = {(row["group"], row["attempt"]): row for row in read_lines(log_dir / MEMBERSHIP_FILE)
              if row.get("event") == "first_commit"}
    restarts = []
    for failure in failures:
        if "group" not in failure:
            continue
        back = firsts.get((failure["group"], failure["attempt"] + 1))
        since = failure.get("time")
        cause = failure.get("cause") or f"rank {failure['rank']} {failure['exit']}"
        restarts.append({"group": failure["group"], "attempt": failure["attempt"] + 1, "cause": cause,
                         "failed_after_step": failure.get("step"),
                         "rejoined_at_step": back["step"] if back else None,
                         "rejoin_s": round(back["time"] - since, 2) if back and since else None})
    return restarts


def fault_tolerance_section(steps: Any, ft: FaultToleranceConfig, log_dir: Path) -> dict[str, Any]:
    """The ``fault_tolerance`` section of ``results.json`` for ``engine=torchft`` (``steps``: this rank's
    ``ReplicaSteps``)."""
    membership = read_lines(log_dir / MEMBERSHIP_FILE)
    quorums = {row["quorum_id"] for row in membership if row.get("event") == "quorum"}
    dropped = [row for row in membership if row.get("event") == "not_committed"]
    restarts = group_restarts(log_dir)
    return {
        "engine": "torchft", "groups": steps.groups, "min_groups": ft.min_groups,
        "restarts": len(restarts),  # of every group (a rank's own restart count is its group's)
        "group_restarts": restarts, "membership_changes": max(0, len(quorums) - 1),
        **steps.counts,
        # every group's, from the log (this group's own count was replaced by its source's if it healed)
        "steps_not_committed": len({row["attempted"] for row in dropped}),
        "group_steps_not_committed": len(dropped),
        "quorum_ms_median": round(1e3 * statistics.median(steps.quorum_s), 2) if steps.quorum_s else None,
    }


def summary_line(section: dict[str, Any]) -> str:
    """``torchft: 3 groups; 1 restart (group 1: ... after step 9, back at step 14 after 2.7 s); 4 steps with fewer
    groups (512 of 768 samples); 1 step not committed``."""
    restarts = section["group_restarts"]
    parts = [f"torchft: {section['groups']} replica groups"]
    if restarts:
        described = []
        for r in restarts:
            done = r.get("failed_after_step")
            when = "" if done is None else f" after step {done}" if done else " before its first step"
            back = (f", back at step {r['rejoined_at_step']} after {r['rejoin_s']} s" if r["rejoin_s"] is not None
                    else ", not back")
            described.append(f"group {r['group']}: {r['cause']}{when}{back}")
        parts.append(f"{len(restarts)} group restart(s) ({'; '.join(described)})")
    else:
        parts.append("no group restarted")
    parts.append(f"{section['steps_with_fewer_groups']} step(s) with fewer groups ({section['samples_in_those_steps']}"
                 f" of {section['samples_full_steps_would_have']} samples)")
    parts.append(f"{section['steps_not_committed']} step(s) not committed")
    if section.get("rows_from_other_groups"):
        parts.append(f"{section['rows_from_other_groups']} logged row(s) from the groups that trained without group 0")
    if section["quorum_ms_median"] is not None:
        parts.append(f"quorum {section['quorum_ms_median']} ms per step (median)")
    return "; ".join(parts)
