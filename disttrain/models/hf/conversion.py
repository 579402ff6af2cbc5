"""Where each tensor of a Hugging Face model comes from in a folder saved in another layout than the model holds.

``transformers`` 5.x holds a mixture's experts as grouped weights (``mlp.experts.gate_up_proj`` ``[E, 2I, H]``,
``down_proj`` ``[E, H, I]``), while ``save_pretrained`` writes, and the hub's checkpoints hold, one tensor per
expert under names of their own (Mixtral's ``block_sparse_moe.experts.E.w1/w2/w3.weight``, Qwen-MoE's
``mlp.experts.E.gate_proj/up_proj/down_proj.weight``). ``from_pretrained`` converts them by the model's conversion
mapping (``transformers.conversion_mapping``): renamings, then converters whose operations stack the per-expert
tensors on a new dim 0 (``MergeModulelist``) and concatenate gate with up (``Concatenate``).

``saved_sources`` applies that same mapping, with ``transformers``' own functions and key by key as
``from_pretrained`` does, to the names in a folder's safetensors headers, and gives each of the model's tensors a
``Source``: a saved tensor, or a stack or concatenation of them. Its shape comes from the headers alone (checked
against ``transformers`` running the converter on meta tensors), and any box of the model's tensor is read from
it by reading only the parts of the saved tensors that the box covers: a rank holding some experts (ep, tp) reads
only those experts' tensors, a ZeRO-3 rank only its rows. A converter with other operations runs
``transformers``' own operations on the whole saved tensors it converts, and the box is cut from the result.
Nothing is read but safetensors, through ``disttrain.safetensors_reader``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from disttrain.models.lora import base_name
from disttrain.models.weights_fit import Saved
from disttrain.safetensors_reader import Box, TensorHeader


@dataclass
class Conversion:
    """How a Hugging Face model's names and layouts differ from its checkpoints' (``transformers``' mapping)."""

    transforms: list[Any]
    """The model's ``WeightRenaming`` and ``WeightConverter`` list, as ``from_pretrained`` applies it."""
    base_model_prefix: str | None = None
    """The prefix a checkpoint of the base model lacks (``model``), which loading adds or strips."""
    model: Any = None
    """The ``transformers`` model (some operations read its config or its parameters' shapes)."""


def conversion_of(net: Any) -> Conversion | None:
    """The conversion of a ``model=hf`` network (``disttrain.models.hf.HFCausalLM``, whose ``_model`` is the
    ``transformers`` model): ``transformers``' ``get_model_conversion_mapping``; None for any other model."""
    model = getattr(net, "_model", None)
    if model is None or not hasattr(model, "base_model_prefix"):
        return None
    from transformers.conversion_mapping import get_model_conversion_mapping

    return Conversion(get_model_conversion_mapping(model), model.base_model_prefix, model)


@dataclass
class Stacked:
    """Tensors of one shape stacked on a new dim (``MergeModulelist``: one tensor per expert)."""

    dim: int
    parts: list[Any]
    shape: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        inner = self.parts[0].shape
        self.shape = (*inner[:self.dim], len(self.parts), *inner[self.dim:])

    def read(self, box: Box) -> torch.Tensor:
        """The ``box``: each part it covers, read on the box's other dims."""
        start, stop = box[self.dim]
        inner = box[:self.dim] + box[self.dim + 1:]
        return torch.stack([self.parts[i].read(inner) for i in range(start, stop)], dim=self.dim)

    def leaves(self) -> list[Saved]:
        """The saved tensors read."""
        return [leaf for part in self.parts for leaf in part.leaves()]


@dataclass
class Joined:
    """Tensors concatenated on a dim (``Concatenate``: gate then up)."""

    dim: int
    parts: list[Any]
    shape: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        first = self.parts[0].shape
        self.shape = (*first[:self.dim], sum(p.shape[self.dim] for p in self.parts), *first[self.dim + 1:])

    def read(self, box: Box) -> torch.Tensor:
        """The ``box``: the covered rows of each part it overlaps on the joined dim."""
        start, stop = box[self.dim]
        pieces, offset = [], 0
        for part in self.parts:
            size = part.shape[self.dim]
            low, high = max(start, offset), min(stop, offset + size)
            if low < high:
                pieces.append(part.read((*box[:self.dim], (low - offset, high - offset), *box[self.dim + 1:])))
            offset += size
        return torch.cat(pieces, dim=self.dim)

    def leaves(self) -> list[Saved]:
        """The saved tensors read."""
        return [leaf for part in self.parts for leaf in part.leaves()]


@dataclass
class Converted:
    """One output of a converter whose operations are run as ``transformers`` runs them, on whole tensors."""

    converter: Any
    layer_name: str
    collected: dict[str, list[Saved]]
    name: str
    shape: tuple[int, ...]
    model: Any = None

    def read(self, box: Box) -> torch.Tensor:
        """The ``box`` of the converter's output (every saved tensor it converts is read whole)."""
        whole = _run(self.converter, self.layer_name, self.collected, self.model,
                     lambda leaf: leaf.read(tuple((0, size) for size in leaf.shape)))[self.name]
        return whole[tuple(slice(start, stop) for start, stop in box)]

    def leaves(self) -> list[Saved]:
        """The saved tensors read."""
        return [leaf for leaves in self.collected.values() for leaf in leaves]


Source = Saved | Stacked | Joined | Converted
"""Where one of the model's tensors comes from."""


def saved_sources(names: Iterable[str], saved: dict[str, TensorHeader],
                  conversion: Conversion | None) -> dict[str, Source]:
    """The source of each of ``names`` (the model's tensors) that the folder's tensors ``saved`` (name -> file,
    shape, dtype) give, through ``conversion``'s renamings and converters (None: each by its own name). A base
    weight that LoRA wraps is found under its name without adapters (``disttrain.models.lora.base_name``). A name
    none gives is left out. ValueError naming the tensor where ``transformers`` fails to convert the folder's."""
    by_base = {base_name(name): name for name in names}
    found = _base_sources(by_base, saved, conversion)
    return {by_base[name]: source for name, source in found.items()}


def _base_sources(names: Iterable[str], saved: dict[str, TensorHeader],
                  conversion: Conversion | None) -> dict[str, Source]:
    """``saved_sources`` of names without adapters."""
    wanted = dict.fromkeys(names, True)
    if conversion is None:
        return {name: Saved.of(name, saved[name]) for name in wanted if name in saved}
    from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

    renamings = [t for t in conversion.transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in conversion.transforms if isinstance(t, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    sources: dict[str, Source] = {}
    groups: dict[str, tuple[Any, dict[str, list[Saved]]]] = {}
    # as from_pretrained: keys in natural order (experts 0, 1, ..., 10), each renamed, then collected by its target
    for key in sorted(saved, key=dot_natural_key):
        renamed, pattern = rename_source_key(key, renamings, converters, conversion.base_model_prefix, wanted)
        if renamed not in wanted and key in wanted:
            renamed, pattern = key, None
        if renamed not in wanted:
            continue
        leaf = Saved.of(key, saved[key])
        if pattern is None:
            sources.setdefault(renamed, leaf)
        else:
            groups.setdefault(renamed, (by_pattern[pattern], {}))[1].setdefault(pattern, []).append(leaf)
    for layer_name, (converter, collected) in groups.items():
        sources.update({name: source for name, source in _converted(converter, layer_name, collected,
                                                                    conversion.model).items() if name in wanted})
    return sources


def _run(converter: Any, layer_name: str, collected: dict[str, list[Saved]], model: Any, load: Any
         ) -> dict[str, torch.Tensor]:
    """``transformers``' conversion (``WeightConverter.convert``) of the tensors ``load`` gives for ``collected``."""
    fresh = copy.deepcopy(converter)  # a converter collects its tensors in itself: one per target, as loading does
    for pattern, leaves in collected.items():
        for leaf in leaves:
            fresh.add_tensor(layer_name, leaf.name, pattern, lambda leaf=leaf: load(leaf))
    return fresh.convert(layer_name, model=model, config=getattr(model, "config", None))


def _converted(converter: Any, layer_name: str, collected: dict[str, list[Saved]], model: Any
               ) -> dict[str, Source]:
    """The outputs of ``converter`` on ``collected``: named and shaped by ``transformers`` on meta tensors, read
    by boxes where its operations only stack and concatenate, else by running them."""
    try:
        on_meta = _run(converter, layer_name, collected, model,
                       lambda leaf: torch.empty(leaf.shape, device="meta"))
    except Exception as err:  # noqa: BLE001 - any operation's refusal: reported with the tensors it converts
        saved = ", ".join(leaf.name for leaves in collected.values() for leaf in leaves[:1])
        raise ValueError(f"{layer_name}: transformers cannot convert the folder's {saved} ... into it "
                         f"({type(err).__name__}: {' '.join(str(err).split())})") from None
    lazy = _stacked_and_joined(converter, layer_name, collected)
    if lazy is not None and {name: s.shape for name, s in lazy.items()} == {
            name: tuple(t.shape) for name, t in on_meta.items()}:
        return lazy
    return {name: Converted(converter, layer_name, collected, name, tuple(t.shape), model)
            for name, t in on_meta.items()}


def _stacked_and_joined(converter: Any, layer_name: str, collected: dict[str, list[Saved]]
                        ) -> dict[str, Source] | None:
    """The converter's operations on ``collected`` as stacks and concatenations that read by boxes, named as
    ``WeightConverter.convert`` names its outputs; None where it has another operation."""
    from transformers.core_model_loading import Concatenate, MergeModulelist

    values: dict[str, Any] = dict(collected)
    targets = converter.target_patterns
    for op in converter.operations:
        if type(op) is MergeModulelist:
            count = len(values)
            values = {op.get_target_pattern(count, pattern, targets): Stacked(op.dim, list(parts))
                      for pattern, parts in values.items()}
        elif type(op) is Concatenate:
            parts = [values[pattern] for pattern in converter.source_patterns if pattern in values]
            if not parts:
                return None
            values = {op.get_target_pattern(targets): Joined(op.dim, parts)}
        else:
            return None
    if any(isinstance(value, list) for value in values.values()):
        return None
    full_name = layer_name.replace("*.", "0.")
    named = next((full_name.partition(key) for key in values if key in full_name), None)
    if named is None:
        return None
    prefix, _, suffix = named
    return {prefix + key + suffix: value for key, value in values.items()}
