"""Loggers: a CSV logger whose file keeps a resumed run's history, and a quieter wandb logger.

Lightning's CSV writer deletes ``metrics.csv`` when its directory is reused, so a run resumed in its own
run directory (``resume=auto``) lost every row before the checkpoint. This writer reads the old rows
first and keeps those of steps before the first step the new process logs: a resumed run continues
the file (steps repeated after an interruption are replaced), and a fresh run in an old directory,
whose first step is 1, starts it anew.
"""

from __future__ import annotations

import csv
from typing import Any

from lightning.pytorch.loggers import CSVLogger as LightningCSVLogger
from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment


class ContinuingWriter(ExperimentWriter):
    """Lightning's writer, plus the old file's rows of steps before the first newly logged step."""

    def _check_log_dir_exists(self) -> None:
        self.history: list[dict[str, str]] = []
        if self._fs.isfile(self.metrics_file_path):
            with self._fs.open(self.metrics_file_path, "r", newline="") as handle:
                self.history = list(csv.DictReader(handle))
            self._fs.rm_file(self.metrics_file_path)

    def save(self) -> None:
        """Write the pending rows; the first time, put the kept history in front of them."""
        if self.history and self.metrics:
            first = min(int(row["step"]) for row in self.metrics)
            kept = [{k: v for k, v in row.items() if v != ""} for row in self.history if int(row["step"]) < first]
            self.metrics = kept + self.metrics
            self.history = []
        super().save()


class CSVLogger(LightningCSVLogger):
    """``lightning.pytorch.loggers.CSVLogger`` that continues a resumed run's ``metrics.csv``."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Lightning's rows, with the epoch written as the whole number it is (logged values are floats)."""
        if "epoch" in metrics:
            metrics = {**metrics, "epoch": int(metrics["epoch"])}
        super().log_metrics(metrics, step)

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        """The writer (created on first use, as in Lightning)."""
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = ContinuingWriter(log_dir=self.log_dir)
        return self._experiment


class WandbLogger(LightningWandbLogger):
    """``lightning.pytorch.loggers.WandbLogger`` without the ``anonymous=None`` it always hands to
    ``wandb.init``, which wandb (0.19 and later) answers with a deprecation warning on every run."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)
