"""Every option of every config group trains a few steps through ``train()``: loggers, callbacks, the
strategy and the Trainer are built, not only the model and the data. The ``parallel`` options run in
``test_parity.py`` (each against one process) and the recipes in ``test_recipes.py``."""

from __future__ import annotations

import json

import pytest

from disttrain.launch.job import train
from tests.conftest import compose_config
from tests.test_configs import CASES, needs

SHORT = ["trainer.max_steps=2", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1",
         "trainer.val_check_interval=2", "trainer.check_val_every_n_epoch=null"]
OPTIONS = [(group, option) for group, option in CASES if group not in ("parallel", "recipe")]


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_option_trains(tmp_path, monkeypatch, group, option):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    overrides = [f"{group}={option}", *SHORT, *needs(group, option, tmp_path)]
    if group == "data" and option == "synthetic_tokens":  # GPT-2's vocabulary and context: shrunk for speed
        overrides += ["data.vocab_size=256", "data.block_size=32"]
    if "model=gpt" in overrides or (group == "model" and option in ("gpt", "llama")):
        overrides.append("model.flavour=micro")
    run_dir = tmp_path / "run"
    train(compose_config(overrides, run_dir))
    results = json.loads((run_dir / "results.json").read_text())
    assert results["global_steps"] == 2
    assert any(key.startswith("test/") for key in results["metrics"]), results["metrics"]
