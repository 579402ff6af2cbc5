"""Loggers: a CSV logger whose file keeps a resumed run's history, and a quieter wandb logger.

Lightning's CSV writer deletes ``metrics.csv`` when its directory is reused, so a run resumed in its own
run directory (``resume=auto``) lost every row before the checkpoint. This logger reads the old rows
first and keeps those of steps before the first step the new process logs: a resumed run continues
the file (steps repeated after an interruption are replaced), and a fresh run in an old directory,
whose first step is 1, starts it anew.
"""

from __future__ import annotations

import csv
import os
import warnings
from typing import Any

from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger
from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment
from lightning.pytorch.utilities import rank_zero_only

from disttrain.lightning_internals import wandb_init_options


class CSVLogger(LightningCSVLogger):
    """``lightning.pytorch.loggers.CSVLogger`` that continues a resumed run's ``metrics.csv``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.history = _rows(os.path.join(self.log_dir, ExperimentWriter.NAME_METRICS_FILE))
        """The old file's rows, read before Lightning's writer deletes the file; those of steps before the first
        newly logged step are written back in front of the new rows."""

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        """Lightning's writer, without its warning that a reused directory's rows will be deleted: the rows
        that belong to this run's history are kept (``history``)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Experiment logs directory .* exists and is not empty")
            return super().experiment

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Lightning's rows, with the epoch written as the whole number it is (logged values are floats)."""
        if "epoch" in metrics:
            metrics = {**metrics, "epoch": int(metrics["epoch"])}
        super().log_metrics(metrics, step)

    @rank_zero_only
    def save(self) -> None:
        """Write the pending rows; the first time, put the kept history in front of them."""
        writer = self.experiment
        if self.history and writer.metrics:
            first = min(int(row["step"]) for row in writer.metrics)
            kept = [{k: v for k, v in row.items() if v != ""} for row in self.history if int(row["step"]) < first]
            writer.metrics[:0] = kept
            self.history = []
        super().save()


def _rows(path: str) -> list[dict[str, str]]:
    """The rows of the CSV file at ``path`` (none where there is no file)."""
    fs = get_filesystem(path)
    if not fs.isfile(path):
        return []
    with fs.open(path, "r", newline="") as handle:
        return list(csv.DictReader(handle))


class WandbLogger(LightningWandbLogger):
    """``lightning.pytorch.loggers.WandbLogger`` without the ``anonymous=None`` it always hands to
    ``wandb.init``, which wandb (0.19 and later) answers with a deprecation warning on every run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        options = wandb_init_options(self)
        if options.get("anonymous") is None:
            options.pop("anonymous", None)
