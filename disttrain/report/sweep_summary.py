"""After a sweep: one table of every job's swept values and objective, and a plot of the objective against each
swept parameter, in the sweep directory (a Hydra callback, run by the process that launched the jobs)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from disttrain.report.plots import pyplot, save
from disttrain.report.results_file import RESULTS_FILE

TABLE_FILE = "summary.csv"
MARKDOWN_FILE = "summary.md"
PLOT_FILE = "objective.png"


def job_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per finished job: its number, its overrides and its results' objective."""
    rows = []
    for job in sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)):
        results, overrides = job / RESULTS_FILE, job / ".hydra" / "overrides.yaml"
        if not results.is_file():
            continue  # a job that failed leaves no results
        given = OmegaConf.load(overrides) if overrides.is_file() else []
        values = dict(str(item).split("=", 1) for item in given if "=" in str(item))
        result = json.loads(results.read_text())
        rows.append({"job": int(job.name), "overrides": values, "objective": result.get("objective"),
                     "metric": result.get("objective_metric")})
    return rows


def swept_keys(rows: list[dict[str, Any]]) -> list[str]:
    """The override keys whose value differs between jobs, in the order the first job lists them."""
    keys = list(dict.fromkeys(key for row in rows for key in row["overrides"]))
    return [key for key in keys if len({row["overrides"].get(key) for row in rows}) > 1]


def write_table(rows: list[dict[str, Any]], keys: list[str], sweep_dir: Path) -> None:
    """summary.csv and summary.md: job, swept values, objective."""
    metric = next((row["metric"] for row in rows if row["metric"]), "objective")
    with open(sweep_dir / TABLE_FILE, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["job", *keys, metric])
        for row in rows:
            writer.writerow([row["job"], *(row["overrides"].get(k, "") for k in keys), row["objective"]])
    lines = [f"| job | {' | '.join(keys)} | {metric} |", "|---" * (len(keys) + 2) + "|"]
    for row in rows:
        value = "" if row["objective"] is None else f"{row['objective']:.4f}"
        lines.append(f"| {row['job']} | {' | '.join(row['overrides'].get(k, '') for k in keys)} | {value} |")
    (sweep_dir / MARKDOWN_FILE).write_text("\n".join(lines) + "\n")


def write_objective_plot(rows: list[dict[str, Any]], keys: list[str], sweep_dir: Path) -> Path | None:
    """One panel per swept parameter: the objective of each job at its value (numbers on a log axis when they
    span more than a factor of 10, anything else as categories)."""
    plt = pyplot()
    scored = [row for row in rows if row["objective"] is not None]
    if plt is None or not keys or not scored:
        return None
    figure, panels = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.2), squeeze=False)
    for axes, key in zip(panels[0], keys, strict=True):
        values = [row["overrides"].get(key, "") for row in scored]
        objective = [row["objective"] for row in scored]
        try:
            numbers = [float(v) for v in values]
        except ValueError:
            categories = list(dict.fromkeys(values))
            axes.plot([categories.index(v) for v in values], objective, "o")
            axes.set_xticks(range(len(categories)), categories)
        else:
            axes.plot(numbers, objective, "o")
            if min(numbers) > 0 and max(numbers) / min(numbers) > 10:
                axes.set_xscale("log")
        axes.set_xlabel(key)
        axes.set_ylabel(scored[0]["metric"] or "objective")
        axes.grid(alpha=0.3)
    return save(figure, plt, sweep_dir / PLOT_FILE)


class SweepSummary(Callback):
    """Writes the sweep's summary table and objective plot when all its jobs have run."""

    def __init__(self, plots: bool = True) -> None:
        self.plots = plots

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        """Summarise the sweep directory's finished jobs."""
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = job_rows(sweep_dir) if sweep_dir.is_dir() else []
        if not rows:
            return
        keys = swept_keys(rows)
        write_table(rows, keys, sweep_dir)
        plot = write_objective_plot(rows, keys, sweep_dir) if self.plots else None
        print(f"\nSweep of {len(rows)} job(s) in {sweep_dir}:\n{(sweep_dir / MARKDOWN_FILE).read_text()}"
              + (f"objective against each swept value: {plot.name}" if plot else ""), flush=True)
