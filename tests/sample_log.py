"""A callback that records which training samples each rank actually trains on, step by step, and the reading of
those records across restarts."""

from __future__ import annotations

import os
from collections import defaultdict, deque
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch


class RecordSamples(pl.Callback):
    """Each rank appends ``attempt step id...`` to ``samples-rank<r>.txt`` in the run directory for every training
    micro-batch it trains on: ``step`` is the optimiser step the micro-batch goes into, ``id`` the sample's index
    in the epoch (and the epoch, as ``epoch * len + index``, for datasets drawn afresh each epoch).

    The ids are taken where the dataset reads the batch (``get_batch``), queued, and checked against the batch
    the step receives, so a prefetched batch is booked to the step that trains on it."""

    def __init__(self) -> None:
        self.fetched: deque[tuple[list[int], torch.Tensor]] = deque()

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        dataset = trainer.datamodule.datasets["train"]
        read = dataset.get_batch

        def recording(indices: list[int]) -> Any:
            batch = read(indices)
            self.fetched.append(([int(i) for i in indices], batch[0].clone()))
            return batch

        dataset.get_batch = recording

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *_: Any) -> None:
        ids, inputs = self.fetched.popleft()
        assert torch.equal(inputs, batch[0].cpu()), "the recorded read is not the batch trained on"
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        with open(Path(trainer.default_root_dir) / f"samples-rank{trainer.global_rank}.txt", "a") as log:
            log.write(f"{attempt} {trainer.global_step + 1} {' '.join(map(str, ids))}\n")


def samples_by_step(run_dirs: list[Path]) -> dict[int, list[int]]:
    """The sample ids every step trained on, over all ranks, as the run's history left them: a step trained in
    several attempts (or runs, ``run_dirs`` in order) counts from the last one, whose weights went on."""
    latest: dict[int, tuple[int, list[int]]] = {}
    for order, run_dir in enumerate(run_dirs):
        rows: dict[tuple[int, int], list[int]] = defaultdict(list)
        for path in sorted(run_dir.glob("samples-rank*.txt")):
            for line in path.read_text().splitlines():
                attempt, step, *ids = map(int, line.split())
                rows[(order * 1000 + attempt, step)] += ids
        for (attempt, step), ids in rows.items():
            if step not in latest or latest[step][0] < attempt:
                latest[step] = (attempt, ids)
    return {step: sorted(ids) for step, (_, ids) in sorted(latest.items())}
