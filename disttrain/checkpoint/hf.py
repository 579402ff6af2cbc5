"""Export a run's checkpoint as a Hugging Face model folder that ``transformers`` uses as it would the original:
``config.json`` (with its KV cache on), ``generation_config.json``, safetensors weights and the run's tokenizer
files, which ``AutoModelForCausalLM.from_pretrained(folder)`` and ``AutoTokenizer.from_pretrained(folder)`` load.

Two models have that format: the built-in ``llama`` (its config and weights mapped by
``disttrain.models.llama_hf``) and ``hf`` (a transformers model, whose parameters already carry HF's names and
whose built network holds its ``PretrainedConfig`` as ``hf_config``). The model is rebuilt on the meta device
from the run's ``config.yaml`` for its sizes and config, and the weights come from the checkpoint.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from disttrain.errors import ConfigError

HF_MODELS = ("llama", "hf")
"""The models whose checkpoints export in Hugging Face's format."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt")
"""The files of a Hugging Face tokenizer folder that an export carries (data each: none is code);
``tokenizer.json`` is the one a folder must hold."""


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
    from disttrain.checkpoint.run_model import merged_model
    from disttrain.models.llama_hf import SIZES, hf_config, to_hf_state_dict

    name = check_hf_model(cfg)
    # one model: each adapter merged into the weight it wraps, under the base model's names
    merged = merged_model(cfg, weights)
    model, net, weights = merged.model, merged.net, merged.weights
    if name == "hf":
        config = copy.deepcopy(net.hf_config)
        # training runs without a KV cache; the exported model generates with one, as the original does
        config.use_cache = True
        config.architectures = [type(net._model).__name__]
        from transformers.core_model_loading import revert_weight_conversion

        # in the layout save_pretrained writes (a mixture's experts one tensor per expert), which other tools read
        saved = revert_weight_conversion(net._model, weights)
        # the parts a grouped weight is split into are views of it: each is written as a tensor of its own
        return config, {name: tensor if name in weights else tensor.clone() for name, tensor in saved.items()}
    dims = net.dims
    sizes = {key: getattr(dims, key) for key in SIZES}
    config = hf_config(sizes, dims.block_size, model.rope_theta, model.norm_eps, weights["embed.tok.weight"].dtype)
    return config, to_hf_state_dict(weights, dims.n_head, dims.n_kv_head)


def run_tokenizer(cfg: DictConfig) -> Path | None:
    """The tokenizer folder a run's data was tokenised with (``data.tokenizer``, as the run read it: relative to
    the working directory), or None for data without one."""
    folder = cfg.data.get("tokenizer")
    return Path(os.path.abspath(os.path.expanduser(folder))) if folder else None


def tokenizer_files(folder: Path) -> dict[str, bytes]:
    """The tokenizer files of ``folder`` (``TOKENIZER_FILES`` it holds), each read as the run reads it and checked
    to be what its name says: ``tokenizer.json`` a tokenizer ``tokenizers`` loads, the JSON files JSON, the rest
    UTF-8 text; ConfigError naming ``data.tokenizer`` for a folder that is not one."""
    from disttrain.data.token_cache import load_tokenizer

    load_tokenizer(str(folder))  # the folder holds a tokenizer.json that parses as one
    files = {}
    for name in TOKENIZER_FILES:
        path = folder / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
            if name.endswith(".json"):
                json.loads(text)
        except ValueError as err:
            raise ConfigError("data.tokenizer", str(folder), f"a tokenizer folder whose {name} is "
                              f"{'JSON' if name.endswith('.json') else 'UTF-8 text'} ({err})") from None
        files[name] = data
    return files


def write_hf_folder(config: Any, weights: dict[str, torch.Tensor], output: Path,
                    max_shard_size: int | str = "5GB", tokenizer: dict[str, bytes] | None = None) -> Path:
    """Write ``config.json``, the ``generation_config.json`` that ``transformers`` derives from it, the
    safetensors weights (sharded with an index above ``max_shard_size``) and the ``tokenizer`` files into a
    staging folder beside ``output``, then rename it to ``output``: a crash leaves no half-written folder there.
    The files get the modes the umask gives new files (safetensors writes its own owner-only)."""
    from huggingface_hub import save_torch_state_dict
    from transformers import GenerationConfig

    from disttrain.checkpoint.atomic import new_file_mode

    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.with_name(output.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)  # what a crashed export left behind
    staging.mkdir()
    config.save_pretrained(staging)
    GenerationConfig.from_model_config(config).save_pretrained(staging)
    save_torch_state_dict(weights, staging, max_shard_size=max_shard_size)
    for name, data in (tokenizer or {}).items():
        (staging / name).write_bytes(data)
    file_mode = new_file_mode()
    for path in staging.iterdir():
        path.chmod(file_mode)
    if output.exists():
        previous = output.with_name(output.name + ".previous")
        shutil.rmtree(previous, ignore_errors=True)
        output.rename(previous)
        staging.rename(output)
        shutil.rmtree(previous)
    else:
        staging.rename(output)
    return output
