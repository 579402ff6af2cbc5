"""``self.log`` skips Lightning's move of a stored result that already lies on the logged value's device, and
only that: other moves, and what is logged, are Lightning's."""

from __future__ import annotations

import copy

import pytest
import torch
from lightning.pytorch.trainer.connectors.logger_connector.result import _Metadata, _ResultCollection, _ResultMetric

from disttrain.rank import logged_values
from disttrain.rank.logged_values import place_logged_values_once, same_device


@pytest.fixture
def moves(monkeypatch):
    """The calls that reach Lightning's own ``_ResultMetric.to``, with the fast path installed."""
    place_logged_values_once()
    calls = []
    original = logged_values._lightning_to

    def counted(self, *args, **kwargs):
        calls.append((args, kwargs))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(logged_values, "_lightning_to", counted)
    return calls


def test_logging_on_the_values_device_moves_nothing_and_keeps_lightnings_mean(moves, monkeypatch):
    deep_copies = []
    real_deepcopy = copy.deepcopy
    monkeypatch.setattr(copy, "deepcopy", lambda *a, **k: deep_copies.append(1) or real_deepcopy(*a, **k))
    results = _ResultCollection(training=True)
    for step, loss in enumerate([2.0, 4.0, 9.0]):
        results.log("training_step", "loss", torch.tensor(loss), on_step=False, on_epoch=True, batch_size=step + 1)
        if step == 0:  # the first call builds the stored result (torchmetrics copies its default states)
            deep_copies.clear()
    assert moves == [] and deep_copies == []
    # Lightning's batch-size-weighted mean: (2 * 1 + 4 * 2 + 9 * 3) / 6
    assert results["training_step.loss"].compute().item() == pytest.approx(37 / 6)


def test_a_move_elsewhere_goes_through_lightning(moves):
    metric = _ResultMetric(_Metadata(fx="training_step", name="loss"), is_tensor=True)
    assert metric.to("cpu") is metric and moves == []
    metric.to("meta")
    assert moves == [(("meta",), {})] and metric.value.device.type == "meta"
    assert metric.to(device=torch.device("meta")) is metric and len(moves) == 1  # there already
    held = _ResultMetric(_Metadata(fx="training_step", name="acc"), is_tensor=False)  # holds a torchmetrics Metric
    held.to("cpu")
    assert len(moves) == 2


def test_devices_compare_by_type_and_index():
    assert same_device(torch.device("cpu"), torch.device("cpu"))
    assert same_device(torch.device("cuda", 1), torch.device("cuda", 1))
    assert not same_device(torch.device("cuda", 0), torch.device("cuda", 1))
    assert not same_device(torch.device("cpu"), torch.device("meta"))
