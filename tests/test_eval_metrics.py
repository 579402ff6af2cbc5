"""``EvalMetrics`` on batches whose losses are computed here directly: overall and per-source losses over the real
targets, perplexity, bits per byte, accuracy, an epoch's sums starting over, and the stages kept apart."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from disttrain.data.base import IGNORE_INDEX
from disttrain.data.spec import DataSpec
from disttrain.loss import token_cross_entropy
from disttrain.rank.eval_metrics import EvalMetrics

VOCAB = 256
SOURCES = ("code", "prose", "unseen")
"""The batches below name the first two only: ``unseen`` is a source no batch reached."""


def text_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logits, targets (two of them padding) and each target's source (both named sources in each row)."""
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 5, VOCAB, generator=generator) * 3
    targets = torch.randint(0, VOCAB, (2, 5), generator=generator)
    targets[0, 4] = targets[1, 0] = IGNORE_INDEX
    sources = torch.tensor([[0, 0, 0, 1, 1], [1, 1, 0, 0, 0]])
    return logits, targets, sources


def direct_losses(batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> dict[str, float]:
    """The mean cross-entropy over all real targets of ``batches``, and over each named source's."""
    logits = torch.cat([b[0].reshape(-1, VOCAB) for b in batches]).double()
    targets = torch.cat([b[1].reshape(-1) for b in batches])
    sources = torch.cat([b[2].reshape(-1) for b in batches])
    real = targets != IGNORE_INDEX
    losses = {"all": F.cross_entropy(logits[real], targets[real]).item()}
    for index, name in enumerate(SOURCES[:2]):
        chosen = real & (sources == index)
        losses[name] = F.cross_entropy(logits[chosen], targets[chosen]).item()
    return losses


def test_text_losses_per_source_over_the_real_targets_and_each_epoch_afresh():
    """Two batches of byte-level text with padding: ``val/loss`` is the mean over every real target, ppl and bpb
    follow from it, each reached source has its own loss and the unreached one no key; the next epoch holds only
    its own batch, and the test stage's sums are apart from validation's (a rank without logits adds nothing)."""
    metrics = EvalMetrics(DataSpec("text", vocab_size=VOCAB, block_size=5, eval_sources=SOURCES),
                          token_cross_entropy)
    assert metrics.monitor == ("val/loss", "min")
    first, second = text_batch(0), text_batch(1)
    for batch in (first, second):
        metrics.add_batch("val", *batch)
    logged = {key: float(value) for key, value in metrics.take_epoch("val").items()}
    want = direct_losses([first, second])
    print(f"logged {logged}; direct {want}")
    assert set(logged) == {"val/loss", "val/ppl", "val/bpb", "val/loss/code", "val/loss/prose"}
    assert logged["val/loss"] == pytest.approx(want["all"], rel=1e-6)
    assert logged["val/ppl"] == pytest.approx(math.exp(want["all"]), rel=1e-6)
    assert logged["val/bpb"] == pytest.approx(want["all"] / math.log(2.0), rel=1e-6)
    assert logged["val/loss/code"] == pytest.approx(want["code"], rel=1e-6)
    assert logged["val/loss/prose"] == pytest.approx(want["prose"], rel=1e-6)
    assert abs(want["code"] - want["prose"]) > 1e-3  # the sources' losses differ: a mix-up would show
    assert metrics.latest == logged

    third = text_batch(2)
    metrics.add_batch("test", *third)
    metrics.add_source_losses("test", None, third[1], third[2])  # a pipeline stage before the last
    metrics.add_batch("val", *third)
    tested = {key: float(value) for key, value in metrics.take_epoch("test").items()}
    validated = {key: float(value) for key, value in metrics.take_epoch("val").items()}
    want = direct_losses([third])
    for stage, got in (("test", tested), ("val", validated)):
        assert got == {f"{stage}/loss": pytest.approx(want["all"], rel=1e-6),
                       f"{stage}/ppl": pytest.approx(math.exp(want["all"]), rel=1e-6),
                       f"{stage}/bpb": pytest.approx(want["all"] / math.log(2.0), rel=1e-6),
                       f"{stage}/loss/code": pytest.approx(want["code"], rel=1e-6),
                       f"{stage}/loss/prose": pytest.approx(want["prose"], rel=1e-6)}, stage
    assert metrics.latest == validated


def test_images_are_scored_by_accuracy_over_the_real_targets():
    """Five images, one of them padding: three of the four real ones predicted right; no perplexity, no source."""
    metrics = EvalMetrics(DataSpec("image", num_classes=3, in_channels=1, image_size=2), token_cross_entropy)
    assert metrics.monitor == ("val/acc", "max")
    logits = torch.tensor([[4.0, 0, 0], [0, 4.0, 0], [0, 0, 4.0], [4.0, 0, 0], [0, 4.0, 0]])
    targets = torch.tensor([0, 1, 2, 2, IGNORE_INDEX])
    metrics.add_batch("test", logits, targets)
    logged = {key: float(value) for key, value in metrics.take_epoch("test").items()}
    real = targets != IGNORE_INDEX
    assert set(logged) == {"test/loss", "test/acc"}
    assert logged["test/acc"] == pytest.approx(0.75)
    assert logged["test/loss"] == pytest.approx(F.cross_entropy(logits[real], targets[real]).item(), rel=1e-6)
