"""The metrics of a task's validation and test epochs: added batch by batch, reduced over the ranks at the epoch's end.

What is measured follows the data (``DataSpec``): the mean loss over the real targets always; perplexity for text
and bits per byte for byte-level text; accuracy for images; and a loss per source where the evaluation batches name
each target's source (``DataSpec.eval_sources``, ``disttrain.rank.source_loss``). The task runs the model and logs;
this object keeps the sums between the two.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from disttrain.data.base import IGNORE_INDEX
from disttrain.data.spec import DataSpec
from disttrain.rank.loss import LossFunction
from disttrain.rank.source_loss import SourceLoss

EVAL_STAGES = ("val", "test")
"""The evaluation stages, as the metric names start: ``val/loss``, ``test/acc``, ..."""

LN2 = math.log(2.0)


class EvalMetrics(nn.Module):
    """Each evaluation stage's loss, perplexity or accuracy and per-source losses, for data described by ``spec``;
    ``loss_fn`` is the task's cross-entropy (compiled with the model or eager), which the per-source losses and
    ``add_batch`` reuse.

    A module so that its metrics' states move with the task to its device. Their states are not persistent: a
    checkpoint holds none of them, and an evaluation always starts from empty sums.
    """

    def __init__(self, spec: DataSpec, loss_fn: LossFunction) -> None:
        super().__init__()
        self.loss_fn = loss_fn
        """The cross-entropy of logits against targets, with a reduction (``disttrain.rank.loss``)."""
        self.is_text = spec.kind == "text"
        """Text is scored by loss and perplexity, images by accuracy."""
        self.is_bytes = self.is_text and spec.vocab_size == 256
        """Byte-level text: the loss also in bits per byte."""
        self.source_names = spec.eval_sources
        """The sources the evaluation batches name, in the order of their indices (empty: none named)."""
        self.losses = nn.ModuleDict({stage: MeanMetric() for stage in EVAL_STAGES})
        """Each stage's mean loss over its real targets, weighted by their number."""
        self.source_losses = nn.ModuleDict({stage: SourceLoss(len(spec.eval_sources)) for stage in EVAL_STAGES}) \
            if spec.eval_sources else None
        """Where evaluation batches name each target's source: each source's loss (None: they name none)."""
        self.accuracies = None if self.is_text else nn.ModuleDict({
            stage: MulticlassAccuracy(spec.num_classes, average="micro", ignore_index=IGNORE_INDEX)
            for stage in EVAL_STAGES
        })
        """Images: each stage's accuracy over its real targets (None: text)."""
        self.latest: dict[str, float] = {}
        """The metrics of the newest validation or test epoch as logged (``val/loss``, ...), reduced over the
        ranks."""

    @property
    def monitor(self) -> tuple[str, str]:
        """The validation metric that ranks checkpoints, and whether higher ("max") or lower is better."""
        return ("val/loss", "min") if self.is_text else ("val/acc", "max")

    def add_batch(self, stage: str, logits: torch.Tensor, targets: torch.Tensor,
                  sources: torch.Tensor | None = None) -> None:
        """Add a batch the model scored as ``logits``: its summed loss and predictions, and its per-target losses
        to their sources' sums where the data names them (``sources``: each target's source)."""
        loss_sum = self.loss_fn(logits, targets, "sum")
        self.add_loss(stage, loss_sum.detach(), logits.detach(), targets)
        if sources is not None:
            self.add_source_losses(stage, logits, targets, sources)

    def add_loss(self, stage: str, loss_sum: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """Add a batch's summed loss and its predictions; padding targets (``IGNORE_INDEX``) count nowhere."""
        count = (targets != IGNORE_INDEX).sum()
        self.losses[stage].update(loss_sum / count.clamp(min=1), weight=count)
        if self.accuracies is not None:
            self.accuracies[stage].update(logits, targets)

    def add_source_losses(self, stage: str, logits: torch.Tensor | None, targets: torch.Tensor,
                          sources: torch.Tensor) -> None:
        """Add a batch's per-target losses to the sums of their sources (``sources``: each target's source, where
        the data names them). ``logits`` None: this rank computed none (a pipeline's stage before the last); it adds
        nothing but counts the batch, so that it joins the epoch's sum over the ranks as the others do."""
        if self.source_losses is None:
            return
        metric = self.source_losses[stage]
        if logits is None:
            nothing = targets.new_empty(0)
            metric.update(nothing.float(), nothing, nothing)
            return
        # a second, per-target cross-entropy: the overall loss stays the summed one it has always been
        metric.update(self.loss_fn(logits, targets, "none").detach(), targets, sources)

    def take_epoch(self, stage: str) -> dict[str, torch.Tensor]:
        """The stage's metrics over all ranks (a collective: every rank calls it), keyed as they are logged
        (``<stage>/loss``, ...); the sums start over for the next epoch and ``latest`` holds the values."""
        # Metrics sync across ranks in compute(); the values are already global.
        loss = self.losses[stage].compute()
        metrics = {f"{stage}/loss": loss}
        if self.accuracies is None:
            metrics[f"{stage}/ppl"] = torch.exp(loss)
            if self.is_bytes:
                metrics[f"{stage}/bpb"] = loss / LN2
        else:
            metrics[f"{stage}/acc"] = self.accuracies[stage].compute()
            self.accuracies[stage].reset()
        self.losses[stage].reset()
        metrics.update(self._source_metrics(stage))
        self.latest = {key: float(value) for key, value in metrics.items()}
        return metrics

    def _source_metrics(self, stage: str) -> dict[str, torch.Tensor]:
        """``<stage>/loss/<source>`` of every source the epoch's batches reached, over all ranks (none where the
        batches named no source)."""
        if self.source_losses is None:
            return {}
        metric = self.source_losses[stage]
        if not metric.update_count:  # the same on every rank: all evaluate the same number of batches
            return {}
        losses, counts = metric.compute()
        metric.reset()
        # a source none of the epoch's batches reached (``limit_val_batches`` stops before it) has no loss to log
        return {f"{stage}/loss/{name}": loss for name, loss, count in zip(self.source_names, losses, counts,
                                                                           strict=True) if count > 0}
