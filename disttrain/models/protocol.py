"""What the parallel code may ask of a model: optional methods with fixed names, and nothing else.

A model is any ``nn.Module`` whose ``forward`` maps a batch of inputs to logits (a tensor, or a ``ModelOutput``,
dict or tuple holding them: see ``logits_of``). It qualifies for a
``parallel`` preset by declaring what that preset needs (or the user declares it in config, under
``parallel.tp_plan``, ``parallel.pipeline_units`` and ``parallel.shard_units``, for a model they cannot edit):

``tp_plan(self) -> dict[str, str]``
    Module-name pattern (``fnmatch`` per dotted part, e.g. ``blocks.*.attn.q``) -> style, the Megatron plan
    over DTensor. Styles: ``colwise`` (output features split over the tp ranks), ``rowwise`` (input features
    split, partial outputs summed), ``per_head`` (a module applied to each attention head's features, on the
    heads a rank holds, such as Qwen3's q/k norms: whole weights whose gradients are summed over the tp ranks),
    ``colwise_gather`` (column-wise, its output gathered whole on every rank) and ``rowwise_whole_input``
    (row-wise on a whole input, each rank using its slice), ``experts`` (a module of ``[n_experts, ...]``
    parameters called as ``experts(hidden, top_k_index, top_k_weights)``: whole experts split over the tp
    ranks), ``mla_kv_a`` (a whole projection whose rotary part is a key every head shares: its gradient is
    summed over the tp ranks; see ``disttrain.parallel.tp_styles``),
    and for sequence parallelism, applied only when it is on:
    ``sequence_norm`` (a norm that runs on the local part of the sequence), ``sequence_gather`` (a module whose
    input arrives split along the sequence and must be whole: attention, MLP, the head) and
    ``sequence_split`` (a module whose whole output is split along the sequence: the embedding). A module
    such as attention must take its head count from the width of its (sharded) projections.

``tp_sizes(self) -> dict[str, int]`` (optional)
    Config key -> size that the tp degree must divide, beyond the projection widths (e.g.
    ``{"model.n_head": 12, "model.n_kv_head": 4}``).

``pipeline_units(self) -> list[str]``
    Ordered names of submodules whose application in turn is the model's forward; each takes and returns
    one tensor. A name that is an ``nn.ModuleList`` stands for its entries. Stages are cut between units.

``shard_units(self) -> list[str]``
    Names of the modules that each become an FSDP unit (and the unit of activation checkpointing);
    a ``ModuleList`` stands for its entries. Default: the entries of the model's ``ModuleList`` children,
    else its large children.

``attention_heads(self) -> dict[str, HeadBlocks]`` (optional)
    Parameter-name pattern (as ``tp_plan``'s, e.g. ``blocks.*.attn.q.weight``) -> where that attention projection
    keeps its heads (``disttrain.models.heads.HeadBlocks``: blocks of the head dimension along its rows or columns),
    for a matrix optimiser that steps each head as its own matrix (``optim.per_head``).

``pretrained(self) -> SafetensorsFolder | None`` (optional)
    A folder of Hugging Face safetensors whose tensors, by this model's parameter names (or, for a ``model=hf``
    model, in a layout ``transformers`` converts from: ``disttrain.models.hf.conversion``), replace its
    initialisation once the model is laid out over its ranks (each rank reads only what it holds). The
    ``disttrain.safetensors_reader.SafetensorsFolder`` carries the refusal its reads raise (a ConfigError on the
    key that named the folder), so the job's check and every rank's read refuse it in the same line.

``pretrained_conversion(self)`` (optional, beside ``pretrained``)
    How the folder's tensors convert into this model's where their layout differs (a ``Conversion`` of
    ``disttrain.models.hf.conversion``; None: they are read by name); the strategy asks for it before the model is
    laid out, since a pipeline stage keeps only its own modules.

``materialize(self, device) -> None`` (with a model built on the meta device)
    Allocate its tensors on ``device`` (``to_empty``) and compute the buffers no checkpoint holds; the strategy
    calls it once the model is laid out, so ZeRO-3 ranks allocate only their shards.

``sequence_split`` (an attribute of the modules that attend or read positions, None while the sequence is whole)
    Context parallelism sets a ``SequenceSplit`` on each of them (``disttrain.parallel.context``).

``expert_parallel`` (an attribute of modules holding grouped experts as ``[n_experts, ...]`` parameters, with an
    ``n_experts`` attribute; None while every rank holds all of them)
    Expert parallelism splits those parameters over the ep ranks and sets an ``ExpertExchange``
    (``disttrain.models.experts``) through which the module sends rows to their experts' ranks.

``balance_group`` and ``aux_loss_scale`` (attributes of a module that adds a batch-wide balance loss to backward,
    such as a Hugging Face mixture's router loss: ``disttrain.models.hf.balance``)
    The run sets the process group of the ranks whose micro-batches make up the step's batch (None: this rank's
    batch is the step's) and the weight the loss enters backward with (1 / forward passes per optimiser step).
    Pipeline stages, which do not run the module's forward, are refused for such a module.

``sequence_split_refusal(self) -> str | None`` (optional, for a model that may lack those modules)
    Why it takes no sequence split, for the message that refuses ``parallel.cp``.

``pipeline_refusal(self) -> str | None`` (optional, for a model whose ``pipeline_units()`` may be empty)
    Why it declares no pipeline units, for the message that refuses ``parallel.pp``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

TP_STYLES = ("colwise", "rowwise", "per_head", "colwise_gather", "rowwise_whole_input", "experts", "mla_kv_a",
             "sequence_norm", "sequence_gather", "sequence_split")
"""The styles a ``tp_plan`` may use (see the module docstring)."""


@runtime_checkable
class TensorParallelModel(Protocol):
    """A model that can be sharded over a tensor-parallel mesh."""

    def tp_plan(self) -> dict[str, str]:
        """Module-name pattern -> one of ``TP_STYLES``."""


@runtime_checkable
class PipelineModel(Protocol):
    """A model that can be cut into pipeline stages."""

    def pipeline_units(self) -> list[str]:
        """Ordered submodule names whose application in turn is ``forward``."""


def expand_units(model: nn.Module, names: list[str]) -> list[str]:
    """``names`` with every ``nn.ModuleList`` replaced by its entries (``blocks`` -> ``blocks.0``, ...)."""
    expanded = []
    for name in names:
        module = model.get_submodule(name)
        if isinstance(module, nn.ModuleList):
            expanded += [f"{name}.{i}" for i in range(len(module))]
        else:
            expanded.append(name)
    return expanded


def logits_of(output: Any) -> torch.Tensor:
    """The logits in what a model's ``forward`` returned: the tensor itself, the ``logits`` of a Hugging Face
    ``ModelOutput`` or a dict, or the first entry of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) or hasattr(output, "logits"):
        logits = output["logits"] if isinstance(output, Mapping) else output.logits
        if isinstance(logits, torch.Tensor):
            return logits
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(f"the model's forward returned a {type(output).__name__}: a tensor of logits, or a ModelOutput, "
                    "dict (with 'logits') or tuple (logits first) holding one")
