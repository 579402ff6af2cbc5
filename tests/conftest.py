"""Shared fixtures: compose configs exactly as ``train.py`` does, with a temporary run directory."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

import disttrain.config  # noqa: F401  (registers the schema)

ROOT = Path(__file__).resolve().parent.parent
CONF = ROOT / "conf"


def compose_config(overrides: list[str], run_dir: Path | str) -> DictConfig:
    """Compose ``conf/train.yaml`` with ``overrides`` and a fixed run directory."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=[*overrides, f"run_dir={run_dir}"])


@pytest.fixture
def make_config(tmp_path: Path):
    """Factory fixture: ``make_config(["model=gpt", ...])`` -> composed DictConfig with run_dir in tmp."""

    def make(overrides: list[str], run_dir: Path | None = None) -> DictConfig:
        return compose_config(overrides, run_dir or tmp_path / "run")

    return make


def single_process_curve(tmp_path_factory: pytest.TempPathFactory, overrides: list[str]) -> list[float]:
    """Train ``overrides`` in one process and return its per-step loss curve (the parity reference)."""
    from disttrain.run import train
    from tests.test_run import step_losses

    run_dir = tmp_path_factory.mktemp("single")
    train(compose_config(overrides, run_dir))
    return step_losses(run_dir)
