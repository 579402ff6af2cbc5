"""Export a run's LoRA adapters alone, in PEFT's format: ``adapter_config.json`` and ``adapter_model.safetensors``,
which ``peft.PeftModel.from_pretrained(base_model, folder)`` loads on the model the run started from.

    python -m disttrain.checkpoint.export RUN_DIR --format peft OUT_DIR

A ``model=hf`` network keeps the ``transformers`` model's own parameter names, so its adapters are saved under the
names PEFT gives them on that model (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from omegaconf import DictConfig

from disttrain.errors import ConfigError


def write_peft_folder(cfg: DictConfig, weights: dict[str, torch.Tensor], output: Path) -> Path:
    """Write the adapters among a run's consolidated ``weights`` (its resolved ``config.yaml`` is ``cfg``) as a PEFT
    adapter folder ``output`` (written beside it, then renamed); ConfigError for a run without adapters or of a
    model other than ``hf``."""
    from safetensors.torch import save_file

    from disttrain.checkpoint.run_model import model_on_meta
    from disttrain.models.lora import adapter_config, adapter_weights

    if cfg.model.get("name") != "hf":
        raise ConfigError("model.name", cfg.model.get("name") or cfg.model.get("_target_"), "hf to export adapters "
                          "in PEFT's format, which loads them on a transformers model (export others with --format pt)")
    _, net = model_on_meta(cfg)
    config = adapter_config(net)
    if config is None:
        raise ConfigError("model.lora.rank", None, "set in the run to export its adapters (--format peft); export "
                          "the whole model with --format hf")
    adapters = adapter_weights(net, weights)
    config.base_model_name_or_path = cfg.model.get("path")
    config.task_type = "CAUSAL_LM"
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.with_name(output.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)  # what a crashed export left behind
    staging.mkdir()
    config.save_pretrained(str(staging))
    save_file(adapters, str(staging / "adapter_model.safetensors"), metadata={"format": "pt"})
    if output.exists():
        shutil.rmtree(output)
    staging.rename(output)
    return output
