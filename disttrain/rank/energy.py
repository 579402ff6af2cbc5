"""Energy a run used: measured by RAPL counters or NVML where readable, else estimated and labelled so.

Sources, first that works: the Linux powercap RAPL package counters (CPU packages and their DRAM, whole
machine, read by each machine's first rank), NVML's energy counter of each rank's GPU, and otherwise an
estimate from CodeCarbon (its CPU power model from the CPU's TDP) when the ``energy`` extra is installed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl

POWERCAP = Path("/sys/class/powercap")
"""Where Linux exposes RAPL energy counters."""


@dataclass(frozen=True)
class RaplZone:
    """One top-level RAPL domain (a CPU package): its counter file and the value at which it wraps."""

    name: str
    """The domain's name (e.g. ``package-0``)."""
    energy_file: Path
    """Its cumulative energy counter, in microjoules."""
    max_range_uj: int
    """The value at which that counter wraps to 0."""


def rapl_zones(root: Path = POWERCAP) -> list[RaplZone]:
    """The readable top-level RAPL zones under ``root`` (``intel-rapl:0``, ``intel-rapl:1``; AMD's are named the
    same). Sub-zones (``intel-rapl:0:0``: cores, DRAM) are parts of their package and are not added again."""
    zones = []
    for path in sorted(root.glob("intel-rapl:*")) if root.is_dir() else []:
        if path.name.count(":") != 1:
            continue
        energy, limit = path / "energy_uj", path / "max_energy_range_uj"
        try:
            int(energy.read_text())
            max_range = int(limit.read_text())
        except (OSError, ValueError):  # since 2020 the counters are readable by root only
            continue
        name = (path / "name").read_text().strip() if (path / "name").exists() else path.name
        zones.append(RaplZone(name, energy, max_range))
    return zones


def counter_delta(before: int, after: int, max_range: int) -> int:
    """Microjoules between two readings of a counter that wraps to 0 after ``max_range`` (at most one wrap:
    at a few hundred watts a 2^32 uJ counter takes minutes to wrap, so the meter also reads on every log step)."""
    return after - before if after >= before else after + max_range + 1 - before


class RaplMeter:
    """Joules from the RAPL package counters, accumulated over readings so that wraps between them count."""

    source = "rapl"
    estimated = False

    def __init__(self, zones: list[RaplZone]) -> None:
        self.zones = zones
        self.joules = 0.0
        self._last = self._read()

    def _read(self) -> list[int]:
        return [int(zone.energy_file.read_text()) for zone in self.zones]

    def update(self) -> None:
        """Add the energy since the previous reading (call often enough that no counter wraps twice)."""
        now = self._read()
        pairs = zip(self._last, now, self.zones, strict=True)
        self.joules += sum(counter_delta(before, after, zone.max_range_uj) for before, after, zone in pairs) / 1e6
        self._last = now

    def finish(self) -> float:
        """The joules since the meter opened."""
        self.update()
        return self.joules

    def so_far(self) -> float:
        """The joules since the meter opened; the meter keeps counting."""
        return self.finish()


class NvmlMeter:
    """Joules from NVML's total-energy counter of one GPU (Volta and later; millijoules, 64-bit: no wrap)."""

    source = "nvml"
    estimated = False

    def __init__(self, device_index: int) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        self._start = pynvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)

    def update(self) -> None:
        """Nothing to do: the counter does not wrap."""

    def finish(self) -> float:
        """The joules since the meter opened."""
        return (self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle) - self._start) / 1e3

    def so_far(self) -> float:
        """The joules since the meter opened, the meter left open (a host read of the driver's counter)."""
        return self.finish()


class CodeCarbonEstimate:
    """CodeCarbon's estimate for the whole machine (CPU power from the CPU's TDP, RAM from its size): a model,
    not a measurement."""

    source = "codecarbon"
    estimated = True

    def __init__(self) -> None:
        import logging

        from codecarbon import OfflineEmissionsTracker

        logging.getLogger("codecarbon").setLevel(logging.ERROR)
        self._tracker = OfflineEmissionsTracker(country_iso_code="USA", save_to_file=False, log_level="error",
                                                tracking_mode="machine")
        self._tracker.start()

    def update(self) -> None:
        """Nothing to do: the tracker samples power on its own thread."""

    def finish(self) -> float:
        """Stop the tracker; its estimate in joules."""
        self._tracker.stop()
        return float(self._tracker.final_emissions_data.energy_consumed) * 3.6e6  # kWh


def open_meter(device: Any, root: Path = POWERCAP) -> Any:
    """The best energy meter for this rank, or None: NVML for a rank's own GPU; else RAPL on a machine's first
    rank (the counters are the whole machine's); else CodeCarbon's estimate there, if installed."""
    if getattr(device, "type", "cpu") == "cuda":
        try:
            return NvmlMeter(device.index or 0)
        except Exception:  # no pynvml, or a GPU without the energy counter
            pass
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return None
    zones = rapl_zones(root)
    if zones:
        return RaplMeter(zones)
    try:
        return CodeCarbonEstimate()
    except Exception:  # codecarbon not installed (the energy extra), or it could not model this machine
        return None


class EnergyMeter(pl.Callback):
    """Meters the energy of ``fit`` (training, validation, checkpoints) on every rank that has a meter and sums
    it over ranks at the end (one all-reduce). RAPL counters are read on every logged step, so a wrap between
    two readings is counted. Where the meter can be read mid-run (RAPL, NVML), the energy after the first logged
    step is kept apart too: the steady state, without the first steps' compilation and warm-up."""

    def __init__(self, log_every_n_steps: int, root: Path | None = None) -> None:
        self.log_every_n_steps = log_every_n_steps
        self.root = root
        """The powercap tree to read (None: the system's)."""
        self.meter: Any = None
        self.joules: float | None = None
        """The run's joules over all ranks (None: no rank could measure or estimate)."""
        self.at_first_log: float | None = None
        """This rank's joules at the end of the first logged step (None: not reached, or not readable mid-run)."""
        self.after_first_log: float | None = None
        """The joules over all ranks from the end of the first logged step to the end of fit."""
        self.source: str | None = None
        self.estimated = False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Open this rank's meter."""
        self.meter = open_meter(trainer.strategy.root_device, self.root or POWERCAP)

    def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
        """Read wrapping counters now and then, and the meter at the first logged step."""
        if self.meter is None or trainer.global_step % self.log_every_n_steps:
            return
        if trainer.global_step == self.log_every_n_steps and hasattr(self.meter, "so_far"):
            self.at_first_log = self.meter.so_far()
        else:
            self.meter.update()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Close the meter and add up all ranks' joules; rank 0's source names the figure."""
        import torch
        import torch.distributed as dist

        own = self.meter.finish() if self.meter is not None else 0.0
        steady = own - self.at_first_log if self.at_first_log is not None else 0.0
        total = torch.tensor([own, float(self.meter is not None), steady, float(self.at_first_log is not None)],
                             dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)
        if total[1] > 0:
            self.joules = float(total[0])
        if total[3] > 0 and total[3] == total[1]:  # every metered rank read its meter at the first logged step
            self.after_first_log = float(total[2])
        if self.meter is not None:
            self.source, self.estimated = self.meter.source, self.meter.estimated

    def result(self, steps: int, global_batch: int) -> dict[str, Any]:
        """The ``energy`` entry of results.json."""
        if self.joules is None:
            return {"joules": None, "source": None, "why": "no readable RAPL counters, no GPU energy counter, and "
                    "codecarbon (pip install 'disttrain[energy]') not installed for an estimate"}
        entry = {"joules": round(self.joules, 3), "per_step": round(self.joules / max(steps, 1), 6),
                 "per_sample": round(self.joules / max(steps * global_batch, 1), 9), "source": self.source,
                 "estimated": self.estimated}
        if self.after_first_log is not None and steps > self.log_every_n_steps:
            entry["after_step"] = self.log_every_n_steps
            entry["per_step_after"] = round(self.after_first_log / (steps - self.log_every_n_steps), 6)
        return entry
