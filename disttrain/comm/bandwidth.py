"""The bandwidth model behind every communication figure: a transfer takes bytes / bandwidth + latency x
messages (the alpha-beta model), for the bytes and sequential messages each rank sends per step.

One machine's loopback cannot show what compression saves on a real network, so speed-ups at other
bandwidths are predicted from measured bytes through this model, and stated as predictions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Link:
    """A link between ranks, as the model sees it."""

    name: str
    """What it stands for, e.g. ``10 Gbit/s Ethernet``."""
    bandwidth_gbit_s: float
    """Bytes per second each rank can send, in Gbit/s."""
    latency_us: float
    """Time per sequential message, in microseconds."""

    def transfer_s(self, nbytes: float, messages: float) -> float:
        """Seconds one rank takes to send ``nbytes`` in ``messages`` sequential messages."""
        return nbytes * 8 / (self.bandwidth_gbit_s * 1e9) + messages * self.latency_us * 1e-6


LINKS = (Link("10 Gbit/s Ethernet", 10.0, 20.0), Link("100 Gbit/s InfiniBand", 100.0, 3.0))
"""Stated links the benchmarks predict for (typical one-way latencies of TCP over Ethernet and of RDMA)."""


def fit_link(name: str, samples: list[tuple[float, float, float]]) -> Link:
    """The link that explains ``samples`` of (bytes, messages, seconds) best, by least squares (at least two
    samples of different sizes)."""
    design = np.array([[nbytes, messages] for nbytes, messages, _ in samples], dtype=float)
    seconds = np.array([s for _, _, s in samples], dtype=float)
    (per_byte, per_message), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    return Link(name, 8 / max(per_byte, 1e-30) / 1e9, max(per_message, 0.0) * 1e6)


def predicted_step_s(measured_step_s: float, measured_link: Link, link: Link, nbytes: float, messages: float) -> float:
    """A step's time on ``link``: the measured step minus what the model says its transfers took on the link it
    was measured on, plus what they would take on ``link`` (compute and encoding stay as measured)."""
    compute = max(measured_step_s - measured_link.transfer_s(nbytes, messages), 0.0)
    return compute + link.transfer_s(nbytes, messages)
