"""The model a finished run trained, rebuilt from its resolved ``config.yaml`` for the readers of its checkpoint
(the exports): its typed model config and network on the meta device, and its consolidated weights as one model,
each LoRA adapter merged into the weight it wraps.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf


@dataclass
class MergedModel:
    """A run's model with its adapters (if any) merged: what an export writes under the base model's names."""

    model: Any
    """The typed model config of the run."""
    net: Any
    """The network the run built, on the meta device; a network with adapters is left without them, holding
    ``weights``."""
    weights: dict[str, torch.Tensor]
    """The model's tensors under the names of the model without adapters (``q.weight``, not
    ``q.base_layer.weight``), each adapted weight ``W + scale * B A`` by PEFT's own merge."""


def run_config(checkpoint: Path, run_dir: Path, needed_for: str = "") -> DictConfig:
    """The resolved ``config.yaml`` of the run that wrote ``checkpoint``; FileNotFoundError naming the run
    directory where it holds none, and what the config is ``needed_for`` where given."""
    if not (run_dir / "config.yaml").is_file():
        raise FileNotFoundError(f"no config.yaml in {run_dir}, the run directory of {checkpoint}"
                                + (f": {needed_for}" if needed_for else ""))
    return OmegaConf.load(run_dir / "config.yaml")


def model_on_meta(cfg: DictConfig) -> tuple[Any, Any]:
    """The typed model config of a run's resolved ``config.yaml`` and the model it describes, built on the meta
    device for the run's data."""
    from disttrain.data import UserDataConfig, build_datamodule
    from disttrain.models import MODELS, build_model
    from disttrain.models.meta import on_meta_device
    from disttrain.models.registry import with_open_fields

    data = cfg.data
    if "_target_" in data:
        data = UserDataConfig(OmegaConf.to_container(data, resolve=True))
    spec = build_datamodule(data, micro_batch_size=1, seed=cfg.get("seed", 0)).spec
    # the run's config passed validation when it ran: merging the model node into its schema is all that is left
    schema = MODELS.get(cfg.model.name).schema
    model = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), with_open_fields(cfg.model, schema)))
    with on_meta_device():
        return model, build_model(model, spec)


def merged_model(cfg: DictConfig, weights: dict[str, torch.Tensor]) -> MergedModel:
    """The model of a run's resolved ``config.yaml`` (``cfg``) holding its consolidated ``weights``, every adapter
    merged into the weight it wraps (``disttrain.models.lora.merged_weights``); a run without adapters keeps its
    weights as they are. A base held in bf16 or nf4 (``model.lora.base_dtype``; a checkpoint holds nf4's
    dequantised, in bf16) is merged in the checkpoint's dtype, so the merged weight is rounded to bf16."""
    from disttrain.models.lora import has_adapters, merged_weights

    model, net = model_on_meta(cfg)
    if has_adapters(net):
        weights = merged_weights(net, weights)
    return MergedModel(model, net, weights)
