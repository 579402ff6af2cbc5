"""The run directory's results file: rank 0 writes it, the job process and the sweep summary read it."""

from __future__ import annotations

import json
from pathlib import Path

RESULTS_FILE = "results.json"
"""In the run directory: the run's figures (metrics, throughput, checkpoints, faults, each kind's section)."""


def objective_of(run_dir: Path) -> float | None:
    """The objective a finished run wrote to its results file (what a Hydra sweeper optimises)."""
    return json.loads((run_dir / RESULTS_FILE).read_text())["objective"]
