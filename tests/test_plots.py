"""A run's pictures: valid PNGs with data on them, read back; skipped cleanly without matplotlib or when off."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from disttrain.report.plots import LOSS_FILE, TIME_FILE, write_run_plots

pytest.importorskip("matplotlib")

RUN = ["trainer.max_steps=20", "trainer.log_every_n_steps=2", "trainer.val_check_interval=10",
       "trainer.check_val_every_n_epoch=null", "trainer.limit_val_batches=2", "trainer.run_test=false", "logger=csv"]


def drawn_pixels(path) -> float:
    """Share of the image's pixels that are not the background: lines, bars, text."""
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)[..., :3]
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    return float(np.mean(np.any(image < 0.95, axis=-1)))


def test_a_run_draws_its_loss_curves_and_wall_time(make_config, tmp_path):
    from disttrain.launch.job import train

    run_dir = tmp_path / "run"
    train(make_config([*RUN, "plots=true"], run_dir))
    loss, wall = run_dir / "plots" / LOSS_FILE, run_dir / "plots" / TIME_FILE
    assert drawn_pixels(loss) > 0.02 and drawn_pixels(wall) > 0.02


def coloured_pixels(path, rgb: tuple[int, int, int]) -> int:
    """Pixels within a small distance of the colour ``rgb`` (matplotlib's default line colours)."""
    import matplotlib.image

    image = matplotlib.image.imread(path)[..., :3]
    return int(np.sum(np.abs(image - np.array(rgb) / 255).max(axis=-1) < 0.08))


def test_the_loss_plot_draws_each_logged_series(tmp_path):
    (tmp_path / "csv").mkdir()
    rows = ["step,train/loss,val/loss"] + [f"{s},{2.0 / s},{'' if s % 5 else 2.2 / s}" for s in range(1, 41)]
    (tmp_path / "csv" / "metrics.csv").write_text("\n".join(rows) + "\n")
    [loss] = write_run_plots(tmp_path, {})
    blue, orange = (31, 119, 180), (255, 127, 14)  # the first and second series
    assert coloured_pixels(loss, blue) > 200 and coloured_pixels(loss, orange) > 50
    only_train = ["step,train/loss,val/loss"] + [f"{s},{2.0 / s}," for s in range(1, 41)]
    (tmp_path / "csv" / "metrics.csv").write_text("\n".join(only_train) + "\n")
    [loss] = write_run_plots(tmp_path, {})
    assert coloured_pixels(loss, blue) > 200 and coloured_pixels(loss, orange) == 0


def test_without_matplotlib_or_when_off_nothing_is_drawn(make_config, tmp_path, monkeypatch):
    from disttrain.launch.job import train

    off = tmp_path / "off"
    train(make_config([*RUN, "plots=false"], off))
    assert not (off / "plots").exists()
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed: import fails
    missing = tmp_path / "missing"
    train(make_config([*RUN, "plots=true"], missing))
    assert not (missing / "plots").exists()
    assert json.loads((missing / "results.json").read_text())["global_steps"] == 20
