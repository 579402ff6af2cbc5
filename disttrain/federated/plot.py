"""The picture of a federated run: accuracy per round (written after training, never on the hot path)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from disttrain.report.plots import pyplot, save

PLOT_FILE = "federated_accuracy.png"


def write_round_plot(history: list[dict[str, Any]], folder: Path) -> Path | None:
    """Plot the global model's validation accuracy and the clients' mean accuracy (with its spread) per round
    into ``folder``; None when matplotlib is not installed or no round has an accuracy."""
    rows = [row for row in history if "client_acc_mean" in row]
    if not rows:
        return None
    plt = pyplot()
    if plt is None:
        return None
    rounds = [row["round"] for row in rows]
    mean = [row["client_acc_mean"] for row in rows]
    spread = [row["client_acc_std"] for row in rows]
    figure, axes = plt.subplots(figsize=(6, 4))
    axes.plot(rounds, mean, label="clients, own data (mean)")
    axes.fill_between(rounds, [m - s for m, s in zip(mean, spread, strict=True)],
                      [m + s for m, s in zip(mean, spread, strict=True)], alpha=0.2, label="clients (± std)")
    validated = [(row["round"], row["val/acc"]) for row in rows if "val/acc" in row]
    if validated:
        axes.plot(*zip(*validated, strict=True), label="global model, validation", marker=".")
    axes.set_xlabel("round")
    axes.set_ylabel("accuracy")
    axes.legend()
    axes.grid(alpha=0.3)
    return save(figure, plt, folder / PLOT_FILE)
