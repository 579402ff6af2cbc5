"""The network of a Hugging Face causal language model under disttrain's protocol, and its builder.

The network keeps the ``transformers`` model's own submodules and parameter names
(``model.layers.0.self_attn.q_proj.weight``), so its checkpoints export to a folder that ``from_pretrained`` reads.
Its parallel plan comes from what the config declares: ``base_model_tp_plan`` (``tp_plan``), ``base_model_pp_plan``
(``pipeline``) and ``base_model_ep_plan`` (``experts``); a model that declares none trains under data parallelism
and ZeRO.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

from disttrain.data.spec import DataSpec
from disttrain.errors import ConfigError
from disttrain.models.attention import SequenceSplit
from disttrain.models.documents import PackedDocuments
from disttrain.models.heads import HeadBlocks
from disttrain.models.hf import attention as hf_attention
from disttrain.models.hf import balance as hf_balance
from disttrain.models.hf import experts as hf_experts
from disttrain.models.hf import pipeline as hf_pipeline
from disttrain.models.hf import tp_plan as hf_plan
from disttrain.models.hf.config import HFConfig, one_line
from disttrain.models.hf.conversion import Conversion, conversion_of
from disttrain.models.meta import on_meta_device
from disttrain.models.registry import MODELS
from disttrain.quiet_imports import transformers_with_models
from disttrain.safetensors_reader import SafetensorsFolder


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM whose ``forward`` maps token ids to logits, holding the model's own
    submodules under their own names (so parameter names are the Hugging Face checkpoint's)."""

    def __init__(self, model: nn.Module, pretrained: SafetensorsFolder | None = None, block_size: int | None = None,
                 document_end: int | None = None) -> None:
        """``document_end``: the token that closes each document of packed windows, whose documents then attend
        only within themselves, at positions restarting at each (``disttrain.models.documents``)."""
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        self.hf_config = model.config
        """The ``transformers`` config the model was built from (exported with its weights)."""
        self.pretrained_folder = pretrained
        """The folder whose safetensors weights replace the random initialisation once the model is laid out."""
        # kept outside the module tree: its submodules are this module's own children
        object.__setattr__(self, "_model", model)
        self._split_refusal = hf_attention.split_refusal(model, block_size)
        """Why the attention takes no sequence split on ``block_size``-token sequences (None: it takes one)."""
        refusal = None if document_end is None else hf_attention.documents_refusal(model)
        if refusal is not None:
            raise ConfigError("data.document_mask", True, f"false for this model: {refusal}")
        self.documents = None if document_end is None else PackedDocuments(document_end)
        """The documents of packed windows, read from the token ids by ``forward`` (None: a window is one
        sequence)."""
        if self._split_refusal is None:  # context parallelism finds the modules that carry the attribute
            hf_attention.take_sequence_splits(model, self.documents)
            self.sequence_split: SequenceSplit | None = None
            """Set by context parallelism: this rank holds a slice of each sequence, whose global positions
            ``forward`` passes to the model (the rotary angles); its attention modules carry the same split."""
        hf_pipeline.prepare_layers(self)
        hf_experts.take_expert_parallel(model)
        hf_balance.take_balance_loss(self, model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, vocab]`` of token ids ``[B, T]`` (the model's ``ModelOutput.logits``)."""
        split = getattr(self, "sequence_split", None)
        if self.documents is not None:  # transformers masks the documents that restarting positions tell apart
            self.documents.read(idx, split)
            positions = self.documents.positions(split)
        else:
            positions = None if split is None else split.positions(idx.size(1), idx.device).unsqueeze(0)
        return hf_balance.logits_with_balance_loss(self, self._model(input_ids=idx, position_ids=positions,
                                                                     use_cache=False))

    def sequence_split_refusal(self) -> str | None:
        """Why the model's attention takes no sequence split (None: it takes one, see
        ``disttrain.models.hf.attention``)."""
        return self._split_refusal

    def tp_plan(self) -> dict[str, str]:
        """The config's ``base_model_tp_plan`` in disttrain's styles (empty: the model declares none)."""
        return hf_plan.tp_plan(self)

    def tp_sizes(self) -> dict[str, int]:
        """Each tp rank holds whole attention heads, query and key/value alike."""
        config = self.hf_config
        sizes = {"model.num_attention_heads": getattr(config, "num_attention_heads", None),
                 "model.num_key_value_heads": getattr(config, "num_key_value_heads", None)}
        return {key: size for key, size in sizes.items() if size}

    def attention_heads(self) -> dict[str, HeadBlocks]:
        """The heads of the attention projections the config's tensor-parallel plan splits (see
        ``disttrain.models.hf.tp_plan.attention_heads``)."""
        return hf_plan.attention_heads(self)

    def pipeline_units(self) -> list[str]:
        """The config's ``base_model_pp_plan`` and the head (empty: its units are not cut, see
        ``pipeline_refusal``)."""
        return hf_pipeline.pipeline_units(self)

    def pipeline_refusal(self) -> str | None:
        """Why the model's declared units are not cut into pipeline stages (None: they are, see
        ``disttrain.models.hf.pipeline``)."""
        return hf_pipeline.pipeline_refusal(self)

    def shard_units(self) -> list[str]:
        """The decoder layers (the classes the model names as never split)."""
        return hf_plan.layer_lists(self)

    def pretrained(self) -> SafetensorsFolder | None:
        """The folder of weights to start from (None: the seeded random initialisation)."""
        return self.pretrained_folder

    def pretrained_conversion(self) -> Conversion | None:
        """How ``transformers`` converts a folder's tensors into this model's (a mixture's experts saved one tensor
        per expert fill its grouped weights), for the ranks' reads of ``pretrained``."""
        return conversion_of(self)

    def materialize(self, device: torch.device) -> None:
        """Allocate a model built on the meta device, whose weights are then read from ``pretrained``, and compute
        the buffers no checkpoint holds (rotary frequencies) as ``transformers`` initialises them."""
        self.to_empty(device=device)
        for module in self.modules():
            if module._non_persistent_buffers_set:
                self._model._init_weights(module)


@MODELS.register("hf", HFConfig)
def build_hf(cfg: HFConfig, spec: DataSpec) -> HFCausalLM:
    """Build the ``transformers`` model that ``cfg`` describes (never downloaded), in fp32 with the attention
    ``cfg.attention`` chooses (SDPA by default; a pipeline stage is fed the masks the model's forward builds for
    it, ``disttrain.models.hf.pipeline``), over a sequence split where the architecture allows one
    (``disttrain.models.hf.attention``). A config ``transformers`` cannot build a model of is a ConfigError naming
    the source and what it raised."""
    transformers = transformers_with_models()
    config = cfg.validate(spec)
    config.use_cache = False
    implementation, _ = cfg.attention(config)
    # starting from a checkpoint, the weights are allocated only once laid out over the ranks (``materialize``)
    with on_meta_device() if cfg.pretrained else nullcontext():
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation,
                                                                  dtype=torch.float32)
        except (AssertionError, ValueError, TypeError, KeyError, IndexError) as err:
            # what the config's values make its modules refuse (a size that does not divide, an id out of range)
            raise ConfigError("model.arch" if cfg.arch else "model.path", cfg.arch or cfg.path,
                              f"a config transformers builds a model of; {type(config).__name__} fails with "
                              f"{one_line(err)}") from None
    return HFCausalLM(model, cfg.pretrained_folder(), spec.block_size,
                      spec.document_end)
