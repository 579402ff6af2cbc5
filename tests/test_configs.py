"""Every config file in conf/ composes, validates and builds (model, data and trainer), so none can rot."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from disttrain.config import validate
from disttrain.data import build_datamodule
from disttrain.models import build_model
from tests.conftest import CONF

GROUPS = ["model", "data", "parallel", "optim", "scheduler", "trainer", "logger", "callbacks", "recipe"]
GPT_ON_TEXT = ["model=gpt", "data=pydocs"]
PARALLEL_NEEDS = {  # presets that need more ranks than 2, or a model with a tensor-parallel plan
    "hsdp": ["trainer.devices=4"],
    "hybrid": ["trainer.devices=4", *GPT_ON_TEXT],
    "tp": ["trainer.devices=2", *GPT_ON_TEXT],
    "pipeline": ["trainer.devices=2", *GPT_ON_TEXT, "model.tie_weights=false"],
}
TEXT_DATA = ("pydocs", "tokens", "synthetic_tokens", "text", "chat", "mixture")
CASES = [(group, path.stem) for group in GROUPS for path in sorted((CONF / group).glob("*.yaml"))]


def token_dir(tmp_path: Path) -> Path:
    """A tiny nanoGPT-style token directory."""
    rng = np.random.default_rng(0)
    for split, size in (("train", 4096), ("val", 1024)):
        rng.integers(0, 300, size, dtype=np.uint16).tofile(tmp_path / f"{split}.bin")
    return tmp_path


def needs(group: str, option: str, tmp_path: Path) -> list[str]:
    """What an option needs beside it to compose and build: files, the other kind of model or data, ranks."""
    overrides = []
    if group == "data" and option == "tokens":
        overrides.append(f"data.path={token_dir(tmp_path)}")
    if group == "data" and option == "text":
        from tests.test_text_data import make_tokenizer, write_corpus

        files, _ = write_corpus(tmp_path / "corpus")
        overrides += [f"data.files=[{','.join(map(str, files))}]", f"data.tokenizer={make_tokenizer(tmp_path / 'tok')}"]
    if group == "data" and option == "chat":
        from tests.test_chat_data import conversations, make_chat_tokenizer, write_jsonl

        rows = write_jsonl(tmp_path / "chat.jsonl", conversations(12))
        overrides += [f"data.files=[{rows}]", f"data.tokenizer={make_chat_tokenizer(tmp_path / 'tok')}",
                      "batch.global_size=8"]
    if group == "data" and option == "mixture":
        from tests.mixture_corpus import mixture_overrides

        overrides += mixture_overrides(tmp_path)[1:]
    if group == "recipe" and option == "gpt_pydocs_mixture":  # its sources, written where this test runs
        from disttrain.data.pydocs_sources import write_pydocs_sources

        paths = write_pydocs_sources(tmp_path / "pydocs_mixture")
        overrides += [f"data.tokenizer={paths['tokenizer']}",
                      f"data.sources=[{{path: {paths['reference']}, weight: 2}}, {{path: {paths['library']}, "
                      f"weight: 1}}, {{path: \"{paths['other']}/*.txt\", weight: 1}}]"]
    if group == "recipe" and option == "hf_lora_chat":  # its model folder, conversations and task, written here
        from tests.test_recipes import lora_chat_overrides

        overrides += lora_chat_overrides(tmp_path)
    if group == "data" and option == "custom":
        overrides.append("data._target_=tests.user_models.digit_splits")
    if group == "data" and option == "image_folder":
        from tests.test_image_folder import write_classes

        overrides += [f"data.path={write_classes(tmp_path / 'images')}", "batch.global_size=8"]
    if group == "parallel" and option != "single":
        overrides += PARALLEL_NEEDS.get(option, ["trainer.devices=2"])
    if group == "data" and option in TEXT_DATA:
        overrides.append("model=gpt")
    if group == "model" and option in ("gpt", "llama", "moe", "custom", "hf"):
        overrides.append("data=pydocs")
    if group == "model" and option == "hf":  # a model type built from its fields (a folder is the other way)
        overrides += ["model.arch=llama", "+model.hidden_size=64", "+model.intermediate_size=128",
                      "+model.num_hidden_layers=2", "+model.num_attention_heads=4", "+model.num_key_value_heads=2"]
    if group == "model" and option == "custom":
        overrides.append("model._target_=tests.user_models.Decoder")
    if group == "optim" and option == "onebit_adam":  # it exchanges its momentum over DDP's ranks
        overrides += ["parallel=ddp", "trainer.devices=2"]
    return overrides


@pytest.mark.parametrize(("group", "option"), CASES, ids=[f"{g}={o}" for g, o in CASES])
def test_config_composes_validates_and_builds(make_config, tmp_path, group, option):
    run = validate(make_config([f"{group}={option}", *needs(group, option, tmp_path)]), world_size=None)
    datamodule = build_datamodule(run.data, micro_batch_size=run.batch.micro_size, seed=run.train.seed)
    model = build_model(run.model, datamodule.spec)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_every_group_has_configs():
    for group in GROUPS:
        assert list((CONF / group).glob("*.yaml")), group


def test_hparams_search_composes(make_config):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["hparams_search=digits_optuna", "run_dir=x"], return_hydra_config=True)
    assert cfg.optimized_metric == "val/acc"
    assert "optuna" in cfg.hydra.sweeper._target_.lower()
