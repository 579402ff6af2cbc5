"""Pictures of a finished run, written by rank 0 after training (never on the hot path): loss curves and where
the wall time went. Matplotlib is optional: without it, or with ``plots=false``, nothing is drawn."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

LOSS_FILE = "loss.png"
TIME_FILE = "wall_time.png"


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def logged_series(metrics_csv: Path, names: tuple[str, ...]) -> dict[str, list[tuple[float, float]]]:
    """(step, value) pairs of each of ``names`` in a CSV logger's file; rows without the value are skipped."""
    series: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    with open(metrics_csv) as handle:
        for row in csv.DictReader(handle):
            for name in names:
                if row.get(name) and row.get("step"):
                    series[name].append((float(row["step"]), float(row[name])))
    return series


def save(figure: Any, plt: Any, path: Path) -> Path:
    """Write ``figure`` as a PNG and free it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return path


def write_loss_plot(metrics_csv: Path, folder: Path) -> Path | None:
    """Training and validation loss against optimiser steps, and validation accuracy where logged."""
    plt = pyplot()
    if plt is None or not metrics_csv.is_file():
        return None
    series = logged_series(metrics_csv, ("train/loss", "val/loss", "val/acc"))
    if not series["train/loss"] and not series["val/loss"]:
        return None
    figure, axes = plt.subplots(figsize=(6, 4))
    for name, style in (("train/loss", "-"), ("val/loss", "o-")):
        if series[name]:
            axes.plot(*zip(*series[name], strict=True), style, label=name, markersize=3)
    axes.set_xlabel("optimiser step")
    axes.set_ylabel("cross-entropy (nats)")
    axes.grid(alpha=0.3)
    handles, labels = axes.get_legend_handles_labels()
    if series["val/acc"]:
        accuracy = axes.twinx()
        accuracy.plot(*zip(*series["val/acc"], strict=True), "s--", color="tab:green", label="val/acc", markersize=3)
        accuracy.set_ylabel("validation accuracy")
        more = accuracy.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    axes.legend(handles, labels)
    return save(figure, plt, folder / LOSS_FILE)


def write_time_plot(throughput: dict[str, Any], samples_per_sec: float | None, folder: Path) -> Path | None:
    """One bar of the wall time from the command, split into startup, training, validation, checkpoints and
    test, titled with the training and end-to-end throughput."""
    plt = pyplot()
    seconds = (throughput or {}).get("seconds") or {}
    if plt is None or not seconds:
        return None
    figure, axes = plt.subplots(figsize=(7, 2.2))
    left = 0.0
    for part, value in seconds.items():
        axes.barh(0, value, left=left, label=f"{part} {value:.1f} s")
        left += value
    axes.set_yticks([])
    axes.set_xlabel("seconds from the command")
    rate = f"training {samples_per_sec:,.0f} samples/s, " if samples_per_sec else ""
    axes.set_title(f"{rate}end to end {throughput.get('end_to_end_samples_per_sec', 0):,.0f} samples/s")
    axes.legend(loc="upper center", bbox_to_anchor=(0.5, -0.45), ncol=3, fontsize="small")
    return save(figure, plt, folder / TIME_FILE)


def write_run_plots(run_dir: Path, results: dict[str, Any]) -> list[Path]:
    """The run's pictures in ``run_dir/plots``; the loss curves need the CSV logger's file."""
    folder = run_dir / "plots"
    written = [write_loss_plot(run_dir / "csv" / "metrics.csv", folder),
               write_time_plot(results.get("throughput") or {}, results.get("samples_per_sec"), folder)]
    return [path for path in written if path is not None]
