"""Pipeline stages of a Hugging Face model, cut between the units its config declares (``base_model_pp_plan``).

The declared units (the embedding, each decoder layer, the final norm) applied in turn, followed by the head, are
the model's forward once every decoder layer that a stage calls on its own receives what the base model's
forward gives it: the position ids, the rotary position embeddings (of the layer's type, for a model that keeps
several, as Gemma 3 keeps local ones for its sliding layers) and the attention mask of the layer's type (causal,
or causal over a sliding window). A hook on each layer supplies them when its caller passes none, built by
``transformers``' own functions: the masks by ``create_masks_for_generate`` (which builds them as the modelling
files do, per ``config.layer_types`` or by ``config.sliding_window``, for the model's attention implementation),
the embeddings by the model's rotary module. Where the model soft-caps its logits after the head (Gemma 2 and 3,
``final_logit_softcapping``), the head caps them when a stage calls it. Embedding scales (Gemma's
``sqrt(hidden_size)``) live inside the embedding module, so the first unit applies them.

A model type is cut only when it is in ``PIPELINE_TYPES``, each checked in the tests ("units in turn == the
model's forward", on a tiny config with sliding windows and per-layer attention types where the family has
them); any other, and a checked type whose config takes it outside what a stage is fed (bidirectional attention,
layer types without a mask function, or that its forward does not read), is refused with the reason.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from torch import nn

from disttrain.models.attention import positions_of
from disttrain.models.documents import PackedDocuments

PIPELINE_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2",
                  "gpt_neox", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss")
"""Model types whose declared units, applied in turn with the inputs this module feeds each decoder layer, equal
the model's forward: each is checked against ``transformers`` in ``tests/test_hf_pipeline.py``."""

MASK_FIELDS = ("layer_types", "sliding_window", "attention_chunk_size")
"""The config fields ``transformers``' ``create_masks_for_generate`` builds masks by; a model type's forward reads
those its config class declares, and a config file may carry others, which the forward then ignores."""


def _base(net: nn.Module) -> nn.Module:
    """The base model (``model``, ``transformer``, ``gpt_neox``) of the Hugging Face causal LM ``net`` wraps."""
    return getattr(net, net._model.base_model_prefix)


def pipeline_refusal(net: nn.Module) -> str | None:
    """Why the model's declared units, applied in turn, cannot be its forward (None: they can, and are cut)."""
    from transformers.masking_utils import LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING

    config = net.hf_config
    model_type = config.model_type
    if not getattr(config, "base_model_pp_plan", None):
        return f"model type {model_type} declares no base_model_pp_plan (the units a pipeline stage is cut from)"
    if model_type not in PIPELINE_TYPES:
        return (f"model type {model_type}'s declared units, applied in turn, are not checked against its forward; "
                f"disttrain cuts pipeline stages of model types {', '.join(PIPELINE_TYPES)}")
    base = _base(net)
    if not isinstance(getattr(base, "layers", None), nn.ModuleList) or getattr(base, "rotary_emb", None) is None:
        return f"model type {model_type} keeps no decoder layers and rotary module where disttrain feeds a stage"
    if getattr(config, "use_bidirectional_attention", False):
        return (f"model type {model_type} with use_bidirectional_attention=true: a stage feeds its layers causal "
                "masks")
    declared = {f.name for f in dataclasses.fields(config)}
    for key in MASK_FIELDS:
        if hasattr(config, key) and key not in declared:
            return (f"model type {model_type} with {key} in its config, which its forward does not read (the masks "
                    "a stage builds would): remove it, or use a model type that reads it")
    unmasked = sorted({t for t in getattr(config, "layer_types", None) or ()
                       if not callable(LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING.get(t))})
    if unmasked:
        return (f"model type {model_type} has layers of types {unmasked}, which transformers gives no single mask "
                "function a stage could build their masks with")
    return None


def pipeline_units(net: nn.Module) -> list[str]:
    """The config's pipeline units under the network's names, and the head (empty: the model's units are not cut,
    ``pipeline_refusal`` says why)."""
    if pipeline_refusal(net) is not None:
        return []
    prefix = net._model.base_model_prefix
    head = net._model.get_output_embeddings()
    head_name = next(name for name, module in net.named_modules() if module is head)
    return [f"{prefix}.{name}" for name in net.hf_config.base_model_pp_plan] + [head_name]


def prepare_layers(net: nn.Module) -> None:
    """Let the units of a model that is cut run on their own: each decoder layer gets, when its caller (a pipeline
    stage) passes none, the positions, rotary embeddings and attention mask the model's forward gives it; the
    head soft-caps its logits where the model's forward does so after it."""
    if pipeline_refusal(net) is not None:
        return
    config = net.hf_config
    base = _base(net)
    feed = StageFeed(base.rotary_emb, config, getattr(net, "documents", None))
    layer_types = getattr(config, "layer_types", None)
    for index, layer in enumerate(base.layers):
        layer_type = layer_types[index] if layer_types else None
        layer.register_forward_pre_hook(LayerFeed(feed, layer_type), with_kwargs=True)
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        running = WholeForward()
        net._model.register_forward_pre_hook(running.enter)
        net._model.register_forward_hook(running.leave, always_call=True)
        net._model.get_output_embeddings().register_forward_hook(SoftCap(cap, running))


class StageFeed:
    """The inputs the base model's forward gives its decoder layers, for hidden states of one shape: positions,
    rotary embeddings (per layer type where the rotary module takes one) and attention masks (per layer type
    where the config has several). The last ones built are kept: the layers of a stage, and a checkpointed
    layer's recomputation, share them as they share the model forward's (one mask, not one per layer, is then
    held for backward)."""

    def __init__(self, rotary: nn.Module, config: Any, documents: PackedDocuments | None = None) -> None:
        """``documents``: those of packed windows, whose positions restart at each document (from which
        ``transformers`` builds masks within each); None: a window is one sequence."""
        self.rotary = rotary
        self.config = config
        self.documents = documents
        layer_types = getattr(config, "layer_types", None)
        takes_type = "layer_type" in inspect.signature(rotary.forward).parameters
        self.rotary_types = sorted(set(layer_types)) if takes_type and layer_types else None
        """The layer types the rotary module computes embeddings for, one set each (Gemma 3's local and global
        ones); None: one set for every layer."""
        self._kept: tuple | None = None

    def inputs(self, hidden: torch.Tensor, split: Any) -> tuple[torch.Tensor, dict, Any]:
        """Position ids ``[1, T]``, rotary embeddings by layer type and the mask (or masks by layer type) for
        ``hidden`` ``[B, T, H]``, at the positions ``split`` gives this rank's tokens (None: ``0 .. T-1``)."""
        from transformers.masking_utils import create_masks_for_generate

        # tensors made in inference mode (validation) cannot be saved for a training step's backward
        key = (tuple(hidden.shape[:2]), hidden.device, hidden.dtype, self.config._attn_implementation,
               torch.is_inference_mode_enabled())
        ids = None if self.documents is None else self.documents.current()  # those of the micro-batch run
        kept = self._kept
        if kept is not None and kept[0] == key and kept[1] is split and kept[5] is ids:
            return kept[2], kept[3], kept[4]
        if any(b.device != hidden.device for b in self.rotary.buffers()):  # it belongs to no stage that moves it
            self.rotary.to(hidden.device)
        if ids is None:
            positions = positions_of(hidden.shape[1], hidden.device, split).unsqueeze(0)
        else:
            positions = self.documents.positions(split)
        embeddings = ({t: self.rotary(hidden, positions, t) for t in self.rotary_types} if self.rotary_types
                      else {None: self.rotary(hidden, positions)})
        masks = create_masks_for_generate(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                          position_ids=positions)
        self._kept = (key, split, positions, embeddings, masks, ids)
        return positions, embeddings, masks


class LayerFeed:
    """A decoder layer's forward pre-hook: the model's inputs for the layer (of ``layer_type``) when its caller
    passes none (a pipeline stage); the model's own forward passes them itself."""

    def __init__(self, feed: StageFeed, layer_type: str | None) -> None:
        self.feed = feed
        self.layer_type = layer_type

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """``args`` and ``kwargs`` with the position ids, rotary embeddings and attention mask added."""
        if kwargs.get("position_embeddings") is not None:
            return None  # the model's own forward passed them
        hidden = args[0] if args else kwargs["hidden_states"]
        # under context parallelism the layer holds a slice of the sequence, at the positions its split says
        split = getattr(getattr(module, "self_attn", None), "sequence_split", None)
        positions, embeddings, masks = self.feed.inputs(hidden, split)
        given = {"position_ids": positions,
                 "position_embeddings": embeddings[self.layer_type if self.feed.rotary_types else None],
                 "attention_mask": masks[self.layer_type] if isinstance(masks, dict) else masks}
        return args, {**kwargs, **given}


class WholeForward:
    """Whether the model's own forward is running (its head's output is then capped by that forward)."""

    def __init__(self) -> None:
        self.depth = 0

    def enter(self, module: nn.Module, args: tuple) -> None:
        """Forward pre-hook of the model."""
        self.depth += 1

    def leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        """Forward hook of the model (called also when its forward raises)."""
        self.depth -= 1


class SoftCap:
    """The head's forward hook: its logits soft-capped at ``cap`` (``cap * tanh(logits / cap)``, as the model's
    forward caps them after the head) when a pipeline stage, not the model's forward, calls it."""

    def __init__(self, cap: float, running: WholeForward) -> None:
        self.cap = cap
        self.running = running

    def __call__(self, module: nn.Module, args: tuple, logits: torch.Tensor) -> torch.Tensor | None:
        """The capped logits, or None (unchanged) inside the model's forward."""
        if self.running.depth:
            return None
        return torch.tanh(logits / self.cap) * self.cap
