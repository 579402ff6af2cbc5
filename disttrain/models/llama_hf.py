"""The built-in Llama in Hugging Face's terms: its config as ``transformers.LlamaConfig``, its weights under HF
Llama's names and layouts, and an HF Llama folder read back into the built-in model's state dict.

Names map one to one (``layers.<i>.attention.q`` is ``model.layers.<i>.self_attn.q_proj`` and so on). The one
change of layout is rotary: the built-in ``apply_rotary`` rotates the interleaved feature pairs ``(2i, 2i+1)``
of each head, HF Llama's ``rotate_half`` the pairs ``(i, i + head_dim/2)``, at the same frequency
``theta**(-2i/head_dim)``. So the rows of the query and key projections are permuted within each head on
export, as Meta's own Llama-to-HF conversion does, and back on import; every other tensor keeps its layout.
Since the permutation keeps shapes, a folder fits the model when each tensor's HF counterpart is there at the
model's shape (``hf_llama_sources``, by the one rule of ``disttrain.models.weights_fit``): the job checks it from
the headers against the model built on the meta device, and a rank again before it reads a tensor.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from disttrain.errors import ConfigError
from disttrain.models.weights_fit import Saved, check_fit
from disttrain.safetensors_reader import ConfigRefusal, SafetensorsFolder

INIT_KEY = "model.init_from"
"""The config key through which a run starts from an HF Llama folder (named in the errors of this module)."""

SIZES = ("n_layer", "n_head", "n_kv_head", "n_embd", "vocab_size", "mlp_hidden")
"""The built-in Llama's sizes that an HF Llama's weights fix (the block size does not: positions are rotary)."""

_HF_FIELD = {"n_layer": "num_hidden_layers", "n_head": "num_attention_heads", "n_kv_head": "num_key_value_heads",
             "n_embd": "hidden_size", "vocab_size": "vocab_size", "mlp_hidden": "intermediate_size"}

_LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.q.weight": "self_attn.q_proj.weight",
    "attention.k.weight": "self_attn.k_proj.weight",
    "attention.v.weight": "self_attn.v_proj.weight",
    "attention.o.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_RECOMPUTED = "rotary_emb.inv_freq"
"""The end of the name of a buffer some older HF checkpoints saved: recomputed from the config, so not a weight
(neither read nor refused)."""
_OUTER_NAMES = {"embed.tok.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}


@dataclass(frozen=True)
class HFLlama:
    """What an HF Llama folder's ``config.json`` says, in the built-in Llama's terms."""

    sizes: dict[str, int]
    """The built-in sizes of ``SIZES`` (``n_layer``, ``n_head``, ...) that its weights have."""
    block_size: int
    """Its ``max_position_embeddings``."""
    rope_theta: float
    """Base of its rotary frequencies."""
    norm_eps: float
    """Its RMSNorm epsilon."""
    tied: bool
    """Whether its output layer shares the token embedding (the built-in output layer then starts as a copy)."""


def hf_name(name: str) -> str:
    """HF Llama's name of the built-in parameter ``name``; KeyError for a name it has no counterpart of."""
    if name in _OUTER_NAMES:
        return _OUTER_NAMES[name]
    _, index, rest = name.split(".", 2)  # layers.<i>.<rest>
    return f"model.layers.{index}.{_LAYER_NAMES[rest]}"


def to_rotate_half(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a query/key projection ``[heads * head_dim, in]`` from interleaved pairs ``(2i, 2i+1)`` to halves
    ``(i, i + head_dim/2)`` within each head (row ``i`` of a head's first half is its former row ``2i``)."""
    rows, cols = weight.shape
    return weight.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def from_rotate_half(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of ``to_rotate_half``: halves back to interleaved pairs within each head."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _heads_of(name: str, n_head: int, n_kv_head: int) -> int | None:
    """The head count whose rows a rotary projection's rows are grouped by; None for any other tensor."""
    if name.endswith(("attention.q.weight", "self_attn.q_proj.weight")):
        return n_head
    if name.endswith(("attention.k.weight", "self_attn.k_proj.weight")):
        return n_kv_head
    return None


def to_hf_state_dict(state: Mapping[str, torch.Tensor], n_head: int, n_kv_head: int) -> dict[str, torch.Tensor]:
    """The built-in Llama's ``state`` under HF Llama's names, queries and keys in the rotate-half layout."""
    out = {}
    for name, tensor in state.items():
        heads = _heads_of(name, n_head, n_kv_head)
        out[hf_name(name)] = (to_rotate_half(tensor, heads) if heads else tensor).contiguous()
    return out


def hf_names(names: Iterable[str], held: Container[str], tied: bool) -> dict[str, str]:
    """The HF tensor each built-in tensor of ``names`` is read from, of those an HF Llama folder holds (``held``):
    its counterpart (``hf_name``), or, for the output layer of a tied HF model saved without ``lm_head.weight``,
    the token embedding. A name whose HF tensor is not held is left out."""
    found = {}
    for name in names:
        key = hf_name(name)
        if key not in held and tied and name == "output.weight":
            key = _OUTER_NAMES["embed.tok.weight"]
        if key in held:
            found[name] = key
    return found


def from_hf_state_dict(state: Mapping[str, torch.Tensor], names: Mapping[str, str], n_head: int,
                       n_kv_head: int) -> dict[str, torch.Tensor]:
    """The built-in Llama's state dict from an HF Llama's tensors ``state``: each built-in name from the HF tensor
    ``names`` maps it to (``hf_names``), queries and keys back to interleaved pairs."""
    out = {}
    for name, key in names.items():
        heads = _heads_of(name, n_head, n_kv_head)
        out[name] = from_rotate_half(state[key], heads).contiguous() if heads else state[key].clone()
    return out


def hf_config(sizes: Mapping[str, int], block_size: int, rope_theta: float, norm_eps: float,
              dtype: torch.dtype = torch.float32) -> Any:
    """``transformers.LlamaConfig`` of the built-in Llama of these sizes (``SIZES``) and settings."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=sizes["vocab_size"], hidden_size=sizes["n_embd"], intermediate_size=sizes["mlp_hidden"],
        num_hidden_layers=sizes["n_layer"], num_attention_heads=sizes["n_head"],
        num_key_value_heads=sizes["n_kv_head"], head_dim=sizes["n_embd"] // sizes["n_head"], hidden_act="silu",
        max_position_embeddings=block_size, rms_norm_eps=norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)}, tie_word_embeddings=False,
        attention_bias=False, mlp_bias=False, architectures=["LlamaForCausalLM"],
        dtype=str(dtype).removeprefix("torch."), bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )


def read_hf_llama(folder: str | Path) -> HFLlama:
    """Read an HF Llama folder's ``config.json`` (no network); ConfigError naming what differs when it is not a
    model the built-in Llama computes exactly."""
    from transformers import AutoConfig

    path = Path(folder)
    if not (path / "config.json").is_file():
        raise ConfigError(INIT_KEY, str(folder), "a folder with a Hugging Face config.json and safetensors weights")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(INIT_KEY, str(folder), f"a readable Hugging Face config.json ({err})") from None
    if config.model_type != "llama":
        raise ConfigError(INIT_KEY, str(folder), f"an HF Llama (model_type 'llama'); its config.json has model_type "
                                                 f"{config.model_type!r}")
    n_head = config.num_attention_heads
    n_kv_head = config.num_key_value_heads or n_head
    rope = dict(getattr(config, "rope_parameters", None) or {})
    differences = [
        f"{field}={value!r} (the built-in Llama has {need})"
        for field, value, need, fits in (
            ("hidden_act", config.hidden_act, "silu", config.hidden_act in ("silu", "swish")),
            ("attention_bias", config.attention_bias, False, not config.attention_bias),
            ("mlp_bias", config.mlp_bias, False, not config.mlp_bias),
            ("rope_type", rope.get("rope_type", "default"), "default (no scaling)",
             rope.get("rope_type", "default") == "default"),
            ("head_dim", getattr(config, "head_dim", None), "hidden_size / num_attention_heads, an even number",
             getattr(config, "head_dim", None) in (None, config.hidden_size // n_head)
             and config.hidden_size % n_head == 0 and (config.hidden_size // n_head) % 2 == 0),
            ("num_key_value_heads", n_kv_head, f"a divisor of num_attention_heads={n_head}", n_head % n_kv_head == 0),
        )
        if not fits
    ]
    if differences:
        raise ConfigError(INIT_KEY, str(folder), "an HF Llama the built-in Llama computes exactly; its config.json "
                                                 f"has {', '.join(differences)}")
    sizes = {key: getattr(config, field) for key, field in _HF_FIELD.items()}
    sizes["n_kv_head"] = n_kv_head
    return HFLlama(sizes, config.max_position_embeddings, float(rope.get("rope_theta", 10000.0)),
                   float(config.rms_norm_eps), bool(config.tie_word_embeddings))


def weights_folder(folder: str | Path) -> SafetensorsFolder:
    """The safetensors weights of the HF Llama folder ``model.init_from`` names (``model.safetensors``, or the
    shards its ``model.safetensors.index.json`` lists), refused as a ConfigError on that key: by the job's check of
    their headers and by each rank's read alike."""
    return SafetensorsFolder(Path(folder), ConfigRefusal(INIT_KEY, str(folder), "an HF Llama folder whose safetensors "
                                                                                "weights are whole and fit the model"))


def hf_llama_sources(folder: str | Path, state: Mapping[str, torch.Tensor]) -> tuple[HFLlama, dict[str, str]]:
    """The HF Llama folder ``model.init_from`` names, and the HF tensor each of the built-in model's tensors
    ``state`` (real, or on the meta device) is read from, from the safetensors headers alone: held against the
    model by the one rule of starting weights (``disttrain.models.weights_fit``), so a tensor the model lacks, one
    the folder lacks, one of another shape or in a dtype that does not cast is a ConfigError on ``model.init_from``
    naming the folder, the file, the tensor and what the model expects."""
    hf = read_hf_llama(folder)
    weights = weights_folder(folder)
    saved = weights.headers()
    names = hf_names(state, saved, hf.tied)
    read = set(names.values())
    strangers = [Saved.of(key, header) for key, header in saved.items()
                 if key not in read and not key.endswith(_RECOMPUTED)]
    check_fit(state, {name: Saved.of(key, saved[key]) for name, key in names.items()}, weights.refuse,
              strangers=strangers, saved_name=hf_name)
    return hf, names


def import_hf_llama(folder: str | Path, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF Llama folder ``model.init_from`` names as the state dict of the built-in model whose tensors are
    ``state`` (names and layouts mapped back): checked by ``hf_llama_sources`` before any tensor is read, so a
    rank refuses a folder as the job does."""
    hf, names = hf_llama_sources(folder, state)
    return from_hf_state_dict(weights_folder(folder).tensors(), names, hf.sizes["n_head"], hf.sizes["n_kv_head"])
