"""Energy per run: RAPL counters (a fake powercap tree, wrap-around included), the labelled estimate, and the
figure in results.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disttrain.rank.energy import RaplMeter, counter_delta, open_meter, rapl_zones

WRAP = 262_143_328_850  # max_energy_range_uj of a real package


def fake_powercap(root: Path, packages: dict[str, int]) -> Path:
    """A powercap tree with one top-level zone per package (and a DRAM sub-zone that must not be added)."""
    for index, (name, energy) in enumerate(packages.items()):
        zone = root / f"intel-rapl:{index}"
        zone.mkdir(parents=True)
        (zone / "name").write_text(name + "\n")
        (zone / "energy_uj").write_text(f"{energy}\n")
        (zone / "max_energy_range_uj").write_text(f"{WRAP}\n")
        sub = root / f"intel-rapl:{index}:0"
        sub.mkdir()
        (sub / "energy_uj").write_text("5\n")
        (sub / "max_energy_range_uj").write_text(f"{WRAP}\n")
    return root


def set_energy(root: Path, index: int, value: int) -> None:
    (root / f"intel-rapl:{index}" / "energy_uj").write_text(f"{value}\n")


def test_rapl_reads_top_level_packages_and_counts_a_wrap(tmp_path):
    root = fake_powercap(tmp_path, {"package-0": WRAP - 1_000_000, "package-1": 10_000_000})
    zones = rapl_zones(root)
    assert [zone.name for zone in zones] == ["package-0", "package-1"]
    meter = RaplMeter(zones)
    set_energy(root, 0, 2_000_000)  # wrapped: 1 J to the top, one more uJ to reach 0, then 2 J
    set_energy(root, 1, 13_000_000)
    meter.update()
    assert meter.joules == pytest.approx(1.000001 + 2.0 + 3.0)
    set_energy(root, 0, 4_000_000)
    assert meter.finish() == pytest.approx(6.000001 + 2.0)
    assert counter_delta(10, 4, 15) == 10  # 10 -> 15, 0, ..., 4: 5 + 1 + 4


def test_unreadable_counters_are_skipped(tmp_path):
    # a counter that cannot be read as a number (here a directory: reading it fails for root too) is left out
    root = fake_powercap(tmp_path, {"package-0": 1, "package-1": 2})
    (root / "intel-rapl:0" / "energy_uj").unlink()
    (root / "intel-rapl:0" / "energy_uj").mkdir()
    (root / "intel-rapl:1" / "energy_uj").write_text("n/a\n")
    assert rapl_zones(root) == []


def test_without_rapl_or_gpu_the_figure_is_codecarbons_estimate_and_says_so(tmp_path, monkeypatch):
    pytest.importorskip("codecarbon")
    import torch

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    meter = open_meter(torch.device("cpu"), tmp_path / "no-powercap")
    assert meter.source == "codecarbon" and meter.estimated
    joules = meter.finish()
    assert joules > 0


def test_the_estimate_is_labelled_and_converted_from_kwh(tmp_path, monkeypatch):
    # CodeCarbon's own tracker (installed with the energy extra) takes 2 s to start; here its interface is
    # stood in for, to check what disttrain does with its answer
    import sys
    import types

    import torch

    class Tracker:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

        def start(self):
            self.started = True

        def stop(self):
            self.final_emissions_data = types.SimpleNamespace(energy_consumed=0.002)  # kWh
            return 1e-4  # kg CO2, which is not energy

    monkeypatch.setitem(sys.modules, "codecarbon", types.SimpleNamespace(OfflineEmissionsTracker=Tracker))
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    meter = open_meter(torch.device("cpu"), tmp_path / "no-powercap")
    assert meter.source == "codecarbon" and meter.estimated
    assert meter._tracker.kwargs["tracking_mode"] == "machine" and not meter._tracker.kwargs["save_to_file"]
    assert meter.finish() == pytest.approx(0.002 * 3.6e6)
    monkeypatch.setenv("LOCAL_RANK", "1")  # the machine's other ranks leave the machine's figure to rank 0
    assert open_meter(torch.device("cpu"), tmp_path / "no-powercap") is None


def test_a_run_reports_its_energy_per_step_and_sample(make_config, tmp_path, monkeypatch):
    from disttrain.launch.job import train
    from disttrain.rank import energy

    root = fake_powercap(tmp_path / "powercap", {"package-0": 0})
    calls = {"n": 0}
    real = RaplMeter._read

    def advancing(self):  # every reading finds 0.5 J more than the last
        calls["n"] += 1
        set_energy(root, 0, 500_000 * calls["n"])
        return real(self)

    monkeypatch.setattr(RaplMeter, "_read", advancing)
    monkeypatch.setattr(energy, "POWERCAP", root)
    run_dir = tmp_path / "run"
    train(make_config(["trainer.max_steps=6", "trainer.log_every_n_steps=2", "trainer.run_test=false",
                       "trainer.limit_val_batches=1", "logger=none"], run_dir))
    result = json.loads((run_dir / "results.json").read_text())["energy"]
    # readings: open, steps 2, 4, 6, finish: four increments of 0.5 J, three of them after the first logged step
    assert result == {"joules": 2.0, "per_step": pytest.approx(2.0 / 6), "per_sample": pytest.approx(2.0 / (6 * 64)),
                      "source": "rapl", "estimated": False, "after_step": 2, "per_step_after": pytest.approx(1.5 / 4)}


def test_energy_off_leaves_it_out(make_config, tmp_path):
    from disttrain.launch.job import train

    run_dir = tmp_path / "run"
    train(make_config(["trainer.max_steps=2", "trainer.run_test=false", "trainer.limit_val_batches=1",
                       "logger=none", "energy=false"], run_dir))
    assert "energy" not in json.loads((run_dir / "results.json").read_text())
