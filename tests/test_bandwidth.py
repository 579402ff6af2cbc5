"""The bandwidth model: transfer time from bytes and messages, a link fitted from timings, a predicted step."""

from __future__ import annotations

import pytest

from disttrain.comm.bandwidth import Link, fit_link, predicted_step_s


def test_transfer_time_is_bytes_over_bandwidth_plus_latency_per_message():
    link = Link("test", bandwidth_gbit_s=10.0, latency_us=20.0)
    assert link.transfer_s(1.25e9, 0) == pytest.approx(1.0)  # 10 Gbit/s is 1.25 GB/s
    assert link.transfer_s(0, 50) == pytest.approx(1e-3)


def test_a_fitted_link_recovers_the_link_that_made_the_timings():
    truth = Link("truth", bandwidth_gbit_s=3.2, latency_us=45.0)
    samples = [(nbytes, messages, truth.transfer_s(nbytes, messages))
               for nbytes, messages in ((1e3, 2), (1e6, 2), (4e6, 6), (16e6, 2))]
    fitted = fit_link("fit", samples)
    assert fitted.bandwidth_gbit_s == pytest.approx(3.2, rel=1e-9)
    assert fitted.latency_us == pytest.approx(45.0, rel=1e-9)


def test_a_predicted_step_keeps_the_compute_and_swaps_the_transfer():
    here, slow = Link("here", 80.0, 10.0), Link("slow", 1.0, 100.0)
    nbytes, messages = 1e6, 4
    compute = 0.05
    measured = compute + here.transfer_s(nbytes, messages)
    assert predicted_step_s(measured, here, slow, nbytes, messages) == pytest.approx(compute + 8e-3 + 4e-4)
