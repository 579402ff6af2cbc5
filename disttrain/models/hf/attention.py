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

Packed windows (``disttrain.models.documents``): the network passes each token's position in its document as
``position_ids``, and ``transformers`` reads restarting positions as packed sequences, building a causal mask
within each (``masking_utils.find_packed_sequence_indices``). So a model whose windows are packed attends with
``ATTENTION_DOCUMENTS``, the same function registered with SDPA's mask function: while the sequence is whole it
runs "sdpa" on that mask; under a split the mask ``transformers`` builds from the local positions is left aside and
each chunk is masked by the whole window's document ids.

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

from disttrain.models.documents import PackedDocuments

ATTENTION = "sdpa_sequence_split"
"""The attention implementation name the supported models are switched to."""
ATTENTION_DOCUMENTS = "sdpa_sequence_split_documents"
"""The same function, with SDPA's mask (which ``transformers`` builds for packed windows), for packed windows."""
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


PACKED_TYPES = ("llama", "qwen3")
"""Model types whose packed windows are checked to attend within each document, as each document alone
(``tests/test_documents.py``)."""


def documents_refusal(model: nn.Module) -> str | None:
    """Why the ``transformers`` model ``model`` cannot attend within the documents of packed windows (None: it
    can)."""
    model_type = model.config.model_type
    if model_type not in PACKED_TYPES:
        return (f"model type {model_type} is not checked to attend within packed documents; model=hf packs them for "
                f"model types {', '.join(PACKED_TYPES)}")
    return None


def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The self-attention module of each decoder layer of a Llama-family ``transformers`` model."""
    return [layer.self_attn for layer in model.get_submodule(model.base_model_prefix).layers]


def take_sequence_splits(model: nn.Module, documents: PackedDocuments | None = None) -> list[nn.Module]:
    """Switch ``model`` to ``ATTENTION`` (``ATTENTION_DOCUMENTS`` with the ``documents`` of packed windows) and give
    its attention modules a ``sequence_split`` attribute (None: the sequence is whole) and ``documents``; returns
    those modules."""
    import transformers
    from transformers.masking_utils import sdpa_mask

    transformers.AttentionInterface.register(ATTENTION, split_attention)
    if documents is not None:
        transformers.AttentionInterface.register(ATTENTION_DOCUMENTS, split_attention)
        transformers.AttentionMaskInterface.register(ATTENTION_DOCUMENTS, sdpa_mask)
    model.set_attn_implementation(ATTENTION if documents is None else ATTENTION_DOCUMENTS)
    modules = attention_modules(model)
    for module in modules:
        module.sequence_split = None
        module.documents = documents
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
    documents = getattr(module, "documents", None)
    if documents is not None:  # the mask of packed local positions is not the split's: the window's ids are
        attention_mask = None
    window = kwargs.get("sliding_window")
    if attention_mask is not None or (window is not None and window < query.size(2) * split.size) or (
            scaling is not None and scaling != query.size(-1) ** -0.5):
        raise ValueError(f"{type(module).__name__} attends with a mask, window or scale a sequence split does not "
                         "apply")
    ids = None if documents is None else documents.current()
    return split.attend(query, key, value, dropout, documents=ids).transpose(1, 2).contiguous(), None
