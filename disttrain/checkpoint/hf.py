"""Export a run's checkpoint as a Hugging Face model folder: ``config.json`` and safetensors weights that
``transformers.AutoModelForCausalLM.from_pretrained(folder)`` loads.

Two models have that format: the built-in ``llama`` (its config and weights mapped by
``disttrain.models.llama_hf``) and ``hf`` (a transformers model, whose parameters already carry HF's names and
whose built network holds its ``PretrainedConfig`` as ``hf_config``). The model is rebuilt on the meta device
from the run's ``config.yaml`` for its sizes and config, and the weights come from the checkpoint.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from disttrain.errors import ConfigError

HF_MODELS = ("llama", "hf")
"""The models whose checkpoints export in Hugging Face's format."""


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


def check_hf_model(cfg: DictConfig) -> str:
    """The run's model name; ConfigError naming it when that model has no Hugging Face format."""
    name = cfg.model.get("name") or cfg.model.get("_target_")
    if name not in HF_MODELS:
        raise ConfigError("model.name", name, f"one of {list(HF_MODELS)} to export in Hugging Face format "
                                              "(export other models with --format pt)")
    return name


def hf_folder(weights: dict[str, torch.Tensor], cfg: DictConfig) -> tuple[Any, dict[str, torch.Tensor]]:
    """The HF config and the HF-named weights of a run's consolidated ``weights``; ConfigError for a model
    without a Hugging Face format."""
    from disttrain.models.llama_hf import SIZES, hf_config, to_hf_state_dict

    name = check_hf_model(cfg)
    model, net = model_on_meta(cfg)
    if name == "hf":
        return net.hf_config, weights
    dims = net.dims
    sizes = {key: getattr(dims, key) for key in SIZES}
    config = hf_config(sizes, dims.block_size, model.rope_theta, model.norm_eps, weights["embed.tok.weight"].dtype)
    return config, to_hf_state_dict(weights, dims.n_head, dims.n_kv_head)


def write_hf_folder(config: Any, weights: dict[str, torch.Tensor], output: Path,
                    max_shard_size: int | str = "5GB") -> Path:
    """Write ``config.json`` and the safetensors weights (sharded with an index above ``max_shard_size``) into a
    staging folder beside ``output``, then rename it to ``output``: a crash leaves no half-written folder there."""
    from huggingface_hub import save_torch_state_dict

    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.with_name(output.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)  # what a crashed export left behind
    staging.mkdir()
    config.save_pretrained(staging)
    save_torch_state_dict(weights, staging, max_shard_size=max_shard_size)
    if output.exists():
        previous = output.with_name(output.name + ".previous")
        shutil.rmtree(previous, ignore_errors=True)
        output.rename(previous)
        staging.rename(output)
        shutil.rmtree(previous)
    else:
        staging.rename(output)
    return output

