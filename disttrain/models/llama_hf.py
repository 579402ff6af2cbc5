"""The built-in Llama in Hugging Face's terms: its config as ``transformers.LlamaConfig``, its weights under HF
Llama's names and layouts, and an HF Llama folder read back into the built-in model's state dict.

Names map one to one (``layers.<i>.attention.q`` is ``model.layers.<i>.self_attn.q_proj`` and so on). The one
change of layout is rotary: the built-in ``apply_rotary`` rotates the interleaved feature pairs ``(2i, 2i+1)``
of each head, HF Llama's ``rotate_half`` the pairs ``(i, i + head_dim/2)``, at the same frequency
``theta**(-2i/head_dim)``. So the rows of the query and key projections are permuted within each head on
export, as Meta's own Llama-to-HF conversion does, and back on import; every other tensor keeps its layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from disttrain.errors import ConfigError
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


def from_hf_state_dict(state: Mapping[str, torch.Tensor], n_layer: int, n_head: int, n_kv_head: int,
                       tied: bool = False) -> dict[str, torch.Tensor]:
    """The built-in Llama's state dict from an HF Llama's ``state``: every built-in name taken from its HF name
    (queries and keys back to interleaved pairs); a tied HF model's embedding also fills ``output.weight``.
    ConfigError naming the tensors that are missing or left over."""
    names = [*_OUTER_NAMES, *(f"layers.{i}.{rest}" for i in range(n_layer) for rest in _LAYER_NAMES)]
    wanted = {name: hf_name(name) for name in names}
    if tied and "lm_head.weight" not in state:
        wanted["output.weight"] = "model.embed_tokens.weight"
    # buffers that some older HF checkpoints saved: recomputed from the config, so not weights
    given = {key for key in state if not key.endswith("rotary_emb.inv_freq")}
    missing, extra = sorted(set(wanted.values()) - given), sorted(given - set(wanted.values()))
    if missing or extra:
        raise ConfigError(INIT_KEY, None, f"an HF Llama's weights; missing {missing[:4]}, unexpected {extra[:4]}")
    out = {}
    for name, key in wanted.items():
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
    return SafetensorsFolder(Path(folder), ConfigRefusal(INIT_KEY, str(folder), "an HF Llama folder with whole "
                                                                                "safetensors weights"))


def import_hf_llama(folder: str | Path) -> tuple[HFLlama, dict[str, torch.Tensor]]:
    """An HF Llama folder as the built-in Llama's sizes and settings and its state dict (names and layouts mapped
    back); ConfigError when the folder does not fit the built-in Llama."""
    hf = read_hf_llama(folder)
    state = from_hf_state_dict(weights_folder(folder).tensors(), hf.sizes["n_layer"], hf.sizes["n_head"],
                               hf.sizes["n_kv_head"], tied=hf.tied)
    return hf, state
