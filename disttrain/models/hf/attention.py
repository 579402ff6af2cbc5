"""Context parallelism for Hugging Face Llama-family models, through ``transformers``' attention interface.

A model of the types in ``SPLIT_TYPES`` attends with ``ATTENTION``, a function registered with
``transformers.AttentionInterface``, and its attention modules and the network (which places the positions)
carry a ``sequence_split`` attribute (see ``disttrain.parallel.context``). While that is None the function is
``transformers``' own SDPA attention; under context parallelism the strategy sets a split, attention covers the
whole sequence through ``SequenceSplit.attend``, and the network passes its tokens' global positions as
``position_ids``, so the rotary angles follow the split.

No mask function is registered under the name, so ``transformers`` creates no mask for it (its rule for an
implementation without one). Both paths want none: the network feeds whole, unpadded sequences, which "sdpa"
attends with ``is_causal`` and no mask too, and a split builds its own mask per chunk (the mask ``transformers``
would build from split positions would read them as packed sequences).

The split is taken only where it leaves the computation as it was: a model built with "sdpa" (the split attends
as it does; eager and flex attention keep their own kernels), keys attended with the default scale
``1 / sqrt(head_dim)``, causal, with no sliding window shorter than the data's sequences, and rotary frequencies
that do not follow the largest position seen (a rank sees only some). Other architectures (learned positions,
softcapping, attention sinks, other scales) get no attribute, and validation refuses ``parallel.cp`` for them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

ATTENTION = "sdpa_sequence_split"
"""The attention implementation name the supported models are switched to."""
SPLIT_TYPES = ("llama", "qwen3", "mistral")
"""Model types whose attention is Llama's: rotary positions from ``position_ids`` and causal scaled dot-product
attention over every earlier token."""


def split_refusal(model: nn.Module, block_size: int | None) -> str | None:
    """Why the ``transformers`` model ``model`` cannot attend over a sequence split on sequences of ``block_size``
    tokens (None: it can)."""
    config = model.config
    allowed = f"model types {', '.join(SPLIT_TYPES)}"
    if config.model_type not in SPLIT_TYPES:
        return f"model type {config.model_type} takes no sequence split; model=hf takes one for {allowed}"
    implementation = config._attn_implementation
    if implementation not in ("sdpa", ATTENTION):  # ATTENTION: already switched to the split
        return (f"model.attn_implementation={implementation} takes no sequence split; model=hf splits {allowed} "
                "attending with sdpa (model.attn_implementation=sdpa)")
    window = getattr(config, "sliding_window", None)
    if window is not None and (block_size is None or window < block_size):
        return (f"its sliding window of {window} tokens is shorter than the sequence ({block_size}); model=hf takes "
                f"a split for {allowed} with no window, or one that covers data.block_size")
    rope_type = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if "dynamic" in rope_type or rope_type == "longrope":
        return (f"its rotary type {rope_type} follows the largest position a rank sees; model=hf takes a split for "
                f"{allowed} with rotary frequencies fixed in advance")
    for module in attention_modules(model):
        if module.scaling != module.head_dim ** -0.5:
            return (f"its attention scales by {module.scaling}, not 1/sqrt(head_dim); model=hf takes a split for "
                    f"{allowed} at that scale")
    return None


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of each decoder layer of a Llama-family ``transformers`` model."""
    return [layer.self_attn for layer in model.get_submodule(model.base_model_prefix).layers]


def take_sequence_splits(model: nn.Module) -> list[nn.Module]:
    """Switch ``model`` to ``ATTENTION`` and give its attention modules a ``sequence_split`` attribute (None: the
    sequence is whole); returns those modules."""
    import transformers

    transformers.AttentionInterface.register(ATTENTION, split_attention)
    model.set_attn_implementation(ATTENTION)
    modules = attention_modules(model)
    for module in modules:
        module.sequence_split = None
    return modules


def split_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """``transformers``' attention function for ``ATTENTION``: queries ``[B, H, t, D]`` and keys and values
    ``[B, Hkv, t, D]`` to the output ``[B, t, H, D]``; SDPA as "sdpa" runs it while ``module.sequence_split`` is
    None, else attention over the whole sequence split over the cp ranks."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    split = getattr(module, "sequence_split", None)
    if split is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    window = kwargs.get("sliding_window")
    if attention_mask is not None or (window is not None and window < query.size(2) * split.size) or (
            scaling is not None and scaling != query.size(-1) ** -0.5):
        raise ValueError(f"{type(module).__name__} attends with a mask, window or scale a sequence split does not "
                         "apply")
    return split.attend(query, key, value, dropout).transpose(1, 2).contiguous(), None
