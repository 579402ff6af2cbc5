"""LoRA adapters through Hugging Face PEFT: ``model.lora`` on every language model, applied where it is built.

``build_model`` hands the built network to ``add_adapters``, which injects PEFT's LoRA layers in place
(``peft.inject_adapter_in_model``: the network keeps its class, its protocol methods and its parallel plan) and
freezes every other parameter, so the optimiser holds state for the adapters only. A wrapped projection's weight is
then named ``<module>.base_layer.weight`` and its adapters ``<module>.lora_A.default.weight`` and
``<module>.lora_B.default.weight``; ``base_name`` maps the first back to the name a folder of base weights holds.
The default targets are the projections the model's own tensor-parallel plan splits (``colwise`` and ``rowwise``
entries), so no list of names lives here.

A network built on the meta device (it starts from a folder's weights) gets its adapters on the meta device too;
their initial values are drawn on the CPU when it is built (PEFT's own initialisation) and kept, so every rank
reads the part of them it holds once the network is laid out, as it reads the folder's weights
(``disttrain.parallel.pretrained``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn

from disttrain import checks
from disttrain.errors import ConfigError, Refusal
from disttrain.quiet_imports import quiet_imports

ADAPTER_NAME = "default"
"""The name PEFT gives the one adapter (it appears in parameter names: ``lora_A.default.weight``)."""
SPLIT_STYLES = ("colwise", "rowwise")
"""The tensor-parallel styles whose modules are the attention and MLP projections: the default targets."""
INITS = {"kaiming": True, "gaussian": "gaussian", "random": False}
"""``model.lora.init`` -> PEFT's ``init_lora_weights``: ``lora_B`` zero (the adapted model starts as the base), or
both matrices random (``random``: the adapters change the output from the first step)."""
BASE_DTYPES = {"keep": None, "bfloat16": torch.bfloat16, "nf4": None}
"""``model.lora.base_dtype`` -> the dtype the frozen base weights are held in when the network is built (None: as
built). ``nf4``'s adapted layers are quantised later, by the rank (``QUANTISED_BASES``)."""
QUANTISED_BASES = ("nf4",)
"""``model.lora.base_dtype`` values whose adapted base layers a rank holds quantised (``disttrain.models.nf4``)."""
BASE_LAYER = "base_layer"
"""The name PEFT gives the layer an adapter wraps, inside the adapter's layer (``q.base_layer.weight``)."""
INITIAL_ADAPTERS = "initial_adapters"
"""Attribute of a network built on the meta device: its adapters' initial values, by parameter name."""


@dataclass
class LoRAConfig:
    """Low-rank adapters (LoRA, or DoRA) on the model's projections; the rest of the model is frozen."""

    rank: int | None = None
    """Rank of each adapter (the inner width of ``lora_B @ lora_A``). None: no adapters, the whole model trains."""
    alpha: float | None = None
    """Scale numerator: the adapter's output is multiplied by ``alpha / rank``. None: equal to ``rank`` (scale 1)."""
    dropout: float = 0.0
    """Dropout probability on the adapters' input (the base layer sees the input whole)."""
    target_modules: list[str] | None = None
    """Modules to adapt, as PEFT matches them: a module's name or its last dotted parts (``q_proj``,
    ``attn.q``). None: the attention and MLP projections that the model's tensor-parallel plan splits."""
    dora: bool = False
    """Weight-decomposed adapters (DoRA: a trained magnitude per output row besides the low-rank direction)."""
    init: str = "kaiming"
    """How the adapters start: ``kaiming`` (``lora_A`` as a Linear layer's init, ``lora_B`` zero: the model starts
    as the base), ``gaussian`` (``lora_A`` normal with std 1/rank, ``lora_B`` zero) or ``random`` (both as a
    Linear layer's init, so the adapters change the output from the first step)."""
    base_dtype: str = "keep"
    """The dtype of the frozen base weights: ``keep`` (as built, fp32), ``bfloat16`` (half the memory) or ``nf4``
    (QLoRA: the adapted projections in 4-bit NormalFloat through bitsandbytes, a quarter of bf16's bytes,
    dequantised to bf16 to compute; embeddings, norms and head as built; single process or DDP). ``bfloat16`` and
    ``nf4`` need ``trainer.precision=bf16-mixed``, which computes in bf16. The adapters stay fp32."""
    double_quant: bool = False
    """QLoRA's double quantisation (``bnb_4bit_use_double_quant`` in PEFT and transformers; bitsandbytes'
    ``compress_statistics``): the nf4 blocks' fp32 absmax are quantised again, to 8 bits in blocks of 256 with one
    fp32 scale each and one fp32 offset per layer: the scales cost 8/64 + 32/(64 x 256) = 0.127 bits per base
    weight instead of 32/64 = 0.5, a saving of about 0.37 bits (4.5 bits a weight become 4.127). Only with
    ``base_dtype=nf4``. A checkpoint holds the base dequantised (bf16), as without it; a resume quantises it back
    to the same 4-bit codes, its blocks' scales within their 8-bit rounding."""

    @property
    def quantises_base(self) -> bool:
        """Whether a rank holds the adapted base layers quantised (``base_dtype=nf4``)."""
        return self.enabled and self.base_dtype in QUANTISED_BASES

    @property
    def enabled(self) -> bool:
        """Whether adapters are added (``rank`` is set)."""
        return self.rank is not None

    def validate(self) -> None:
        """ConfigError for a value the adapters cannot take; nothing when off or fine."""
        if self.double_quant and not self.quantises_base:
            held = f"base_dtype is {self.base_dtype}" if self.enabled else "model.lora.rank is null: no adapters"
            raise ConfigError("model.lora.double_quant", self.double_quant, "false unless the base is held in nf4 "
                              f"(model.lora.base_dtype=nf4 with model.lora.rank set; {held})")
        if not self.enabled:
            return
        if isinstance(self.rank, bool) or self.rank <= 0:
            raise ConfigError("model.lora.rank", self.rank, "a positive integer (the adapters' rank), or null for "
                              "no adapters")
        checks.positive("model.lora.alpha", self.alpha, optional=True)
        checks.probability("model.lora.dropout", self.dropout)
        checks.one_of("model.lora.init", self.init, tuple(INITS))
        checks.one_of("model.lora.base_dtype", self.base_dtype, tuple(BASE_DTYPES))
        if self.quantises_base and self.dora:
            raise ConfigError("model.lora.dora", True, f"false with model.lora.base_dtype={self.base_dtype} (DoRA's "
                              "magnitudes are norms of the base weight's rows, which is held quantised)")
        if self.target_modules is not None and not self.target_modules:
            raise ConfigError("model.lora.target_modules", [], "a list of module names, or null for the "
                              "projections of the model's plan")

    def peft_config(self, targets: list[str]) -> Any:
        """PEFT's ``LoraConfig`` of these settings on ``targets``."""
        with quiet_imports():
            from peft import LoraConfig

        return LoraConfig(r=self.rank, lora_alpha=self.alpha if self.alpha is not None else self.rank,
                          lora_dropout=self.dropout, target_modules=targets, use_dora=self.dora,
                          init_lora_weights=INITS[self.init], bias="none")


def add_adapters(net: nn.Module, lora: LoRAConfig) -> nn.Module:
    """``net`` with PEFT's LoRA layers injected in place on ``lora``'s targets, every other parameter frozen and
    held in ``lora.base_dtype``. ConfigError when a target names no module of ``net``, or when ``net`` declares no
    plan to take the default targets from."""
    lora.validate()
    try:
        with quiet_imports():
            from peft import inject_adapter_in_model
    except ImportError:
        raise ConfigError("model.lora.rank", lora.rank, "null unless peft is installed (pip install "
                          "'disttrain[finetune]')") from None
    targets = lora.target_modules or default_targets(net)
    _check_targets(net, targets)
    on_meta = any(p.is_meta for p in net.parameters())
    starting_weights = getattr(net, "pretrained", None)
    if lora.dora and callable(starting_weights) and starting_weights() is not None:
        raise ConfigError("model.lora.dora", True, "false with model.pretrained=true (DoRA's magnitudes are "
                          "computed from the base weights when the adapters are made, before the folder is read)")
    # PEFT keeps its config on the model (``peft_config``), which an export writes as ``adapter_config.json``
    inject_adapter_in_model(lora.peft_config(targets), net, adapter_name=ADAPTER_NAME)
    dtype = BASE_DTYPES[lora.base_dtype]
    for name, param in net.named_parameters():
        if dtype is not None and not is_adapter(name):  # PEFT has frozen them
            param.data = param.data.to(dtype)
    if on_meta:
        setattr(net, INITIAL_ADAPTERS, _initial_adapters(net, lora))
    if lora.quantises_base:  # the rank quantises them once their weights are final (disttrain.models.nf4)
        from disttrain.models.nf4 import QUANTISE_BASE, NF4Format

        setattr(net, QUANTISE_BASE, NF4Format(double_quant=lora.double_quant))
    return net


def default_targets(net: nn.Module) -> list[str]:
    """The last names of the modules the model's tensor-parallel plan splits column- or row-wise (its attention
    and MLP projections). ConfigError when the model declares no such plan."""
    method = getattr(net, "tp_plan", None)
    plan: dict[str, str] = {}
    if callable(method):
        try:
            plan = method()
        except ConfigError:  # a plan whose styles tensor parallelism refuses still names the projections
            plan = {}
    patterns = [pattern.split(".") for pattern, style in plan.items() if style in SPLIT_STYLES]
    names = sorted({name.rpartition(".")[2] for name, module in net.named_modules()
                    if isinstance(module, nn.Linear) and any(_matches(name.split("."), parts) for parts in patterns)})
    if not names:
        raise ConfigError("model.lora.target_modules", None, f"a list of modules to adapt: "
                          f"{type(net).__name__} declares no tensor-parallel plan to take its projections from "
                          f"(linear layers: {', '.join(linear_names(net)) or 'none'})")
    return names


def linear_names(net: nn.Module) -> list[str]:
    """The last names of ``net``'s linear layers, which LoRA can adapt."""
    return sorted({name.rpartition(".")[2] for name, module in net.named_modules() if isinstance(module, nn.Linear)})


def _check_targets(net: nn.Module, targets: list[str]) -> None:
    """Every target names a linear layer of ``net`` (its name or its last dotted parts, as PEFT matches them)."""
    names = [name for name, module in net.named_modules() if isinstance(module, nn.Linear)]
    for target in targets:
        if not any(name == target or name.endswith(f".{target}") for name in names):
            raise ConfigError("model.lora.target_modules", list(targets), f"names of the model's linear layers; "
                              f"{target!r} is none of them (they are {', '.join(linear_names(net))})")


def _matches(name: list[str], pattern: list[str]) -> bool:
    return len(name) == len(pattern) and all(fnmatchcase(n, p) for n, p in zip(name, pattern, strict=True))


def lora_layers(net: nn.Module) -> list[tuple[str, Any]]:
    """PEFT's LoRA layers of ``net`` with their names."""
    with quiet_imports():
        from peft.tuners.lora import LoraLayer

    return [(name, module) for name, module in net.named_modules() if isinstance(module, LoraLayer)]


def adapter_config(net: nn.Module) -> Any:
    """PEFT's ``LoraConfig`` of ``net``'s adapters (None: it has none)."""
    return (getattr(net, "peft_config", None) or {}).get(ADAPTER_NAME)


def has_adapters(net: nn.Module) -> bool:
    """Whether ``net`` holds LoRA adapters."""
    return adapter_config(net) is not None


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (under one of PEFT's adapter layers, ``lora_A``, ...)."""
    with quiet_imports():
        from peft.tuners.lora import LoraLayer

    return any(part in LoraLayer.adapter_layer_names for part in name.split("."))


def base_name(name: str) -> str:
    """The name a wrapped base weight has in the model without adapters (``q_proj.base_layer.weight`` ->
    ``q_proj.weight``), as a folder of base weights holds it."""
    return ".".join(part for part in name.split(".") if part != BASE_LAYER)


def holds_adapters(names: Iterable[str]) -> bool:
    """Whether the names of a model's tensors (a checkpoint's) are those of a model with adapters, which wraps
    each adapted layer as ``<module>.base_layer``. Reads the names alone, without PEFT, which an export of a
    run without adapters does not need."""
    return any(BASE_LAYER in name.split(".") for name in names)


def _initial_adapters(net: nn.Module, lora: LoRAConfig) -> dict[str, torch.Tensor]:
    """Initial values of the adapters of a network on the meta device, drawn on the CPU as PEFT draws them when it
    makes them (each matrix as a Linear layer, then PEFT's reset), by parameter name."""
    initial = {}
    for name, layer in lora_layers(net):
        parts = [getattr(layer, part) for part in ("lora_A", "lora_B")]
        for adapters in parts:
            meta = adapters[ADAPTER_NAME]
            adapters[ADAPTER_NAME] = nn.Linear(meta.in_features, meta.out_features, bias=meta.bias is not None,
                                               device="cpu")
        layer.reset_lora_parameters(ADAPTER_NAME, INITS[lora.init])
        for part, adapters in zip(("lora_A", "lora_B"), parts, strict=True):
            for pname, value in adapters[ADAPTER_NAME].named_parameters():
                initial[f"{name}.{part}.{ADAPTER_NAME}.{pname}"] = value.detach().clone()
            adapters[ADAPTER_NAME] = adapters[ADAPTER_NAME].to("meta")
    return initial


def adapter_counts(net: nn.Module) -> tuple[int, int]:
    """The adapters' parameter count and the model's."""
    adapters = sum(p.numel() for name, p in net.named_parameters() if is_adapter(name))
    return adapters, sum(p.numel() for p in net.parameters())


def adapter_summary(net: nn.Module) -> str | None:
    """The start-up line of a model with adapters: their parameter count, share of the model and targets (None
    without adapters)."""
    config = adapter_config(net)
    if config is None:
        return None
    adapters, total = adapter_counts(net)
    kind = "DoRA" if config.use_dora else "LoRA"
    return (f"model.lora: {kind} rank {config.r} on {', '.join(sorted(config.target_modules))}: {adapters:,} "
            f"trainable parameters, {adapters / total:.2%} of {total:,}; the rest frozen")


class InitialValue:
    """An adapter's initial value held in memory, read by boxes as a folder's tensor is
    (``disttrain.models.weights_fit.Saved``)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.shape = tuple(tensor.shape)

    def read(self, box: tuple[tuple[int, int], ...]) -> torch.Tensor:
        """The ``box`` (``(start, stop)`` per dim) of the value."""
        return self.tensor[tuple(slice(start, stop) for start, stop in box)]


def initial_adapter_sources(net: nn.Module) -> dict[str, InitialValue]:
    """The initial values of the adapters of a network built on the meta device (before it is laid out), by
    parameter name; empty for any other network."""
    return {name: InitialValue(value) for name, value in getattr(net, INITIAL_ADAPTERS, {}).items()}


def merged_weights(net: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``weights`` of ``net`` (a model with adapters, maybe on the meta device) with each adapter merged into the
    weight it wraps by PEFT's own ``merge``, under the names of the model without adapters. ``net`` takes the
    tensors of ``weights`` as its own and is left without adapters."""
    net.load_state_dict(weights, strict=True, assign=True)
    with torch.no_grad():
        for name, layer in lora_layers(net):
            layer.merge(adapter_names=[ADAPTER_NAME])
            parent, _, child = name.rpartition(".")
            setattr(net.get_submodule(parent) if parent else net, child, layer.get_base_layer())
    return {name: tensor.detach() for name, tensor in net.state_dict().items()}


def adapter_weights(net: nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of ``weights`` (a model's consolidated tensors) as PEFT saves them for a model it wraps
    (``base_model.model.<name>``, the adapter's name left out: ``get_peft_model_state_dict``)."""
    with quiet_imports():
        from peft.utils import get_peft_model_state_dict

    own = get_peft_model_state_dict(net, state_dict=weights, adapter_name=ADAPTER_NAME,
                                    save_embedding_layers=False)
    return {f"base_model.model.{name}": tensor.contiguous() for name, tensor in own.items()}


def adapter_parts(module: nn.Module) -> tuple[str, str, str] | None:
    """The names, inside a LoRA layer, of the layer it wraps, of its down projection (``lora_A``, input features
    -> rank) and of its up projection (``lora_B``, rank -> output features); None for any other module."""
    if not (hasattr(module, "base_layer") and hasattr(module, "lora_A") and hasattr(module, "lora_B")):
        return None
    return BASE_LAYER, f"lora_A.{ADAPTER_NAME}", f"lora_B.{ADAPTER_NAME}"


def uses_dora(module: nn.Module) -> bool:
    """Whether a LoRA layer's adapter is DoRA (its magnitudes are norms of whole weight rows)."""
    return bool(getattr(module, "use_dora", {}).get(ADAPTER_NAME, False))


def check_base_precision(lora: LoRAConfig | None, precision: str) -> None:
    """ConfigError for base weights held in bf16 under a precision that computes in fp32 (a bf16 weight meets an
    fp32 input there)."""
    if (lora is not None and lora.enabled and lora.base_dtype in ("bfloat16", *QUANTISED_BASES)
            and not precision.startswith("bf16")):
        raise ConfigError("model.lora.base_dtype", lora.base_dtype, f"keep with trainer.precision={precision}, or "
                          f"trainer.precision=bf16-mixed ({lora.base_dtype} base weights need bf16 compute)")


def check_quantised_base(lora: LoRAConfig | None, net: nn.Module) -> None:
    """ConfigError, before ranks start, for a quantised base (``nf4``) that cannot be made: bitsandbytes missing,
    or an adapted layer of ``net`` (with its adapters, maybe on the meta device) that nf4 does not take. Readers
    of a finished run (export, generation) build the network without quantising it and need neither."""
    if lora is None or not lora.quantises_base:
        return
    from disttrain.models.nf4 import check_quantisable, require_bitsandbytes

    require_bitsandbytes()
    check_quantisable([(name, layer.get_base_layer()) for name, layer in lora_layers(net)])


def base_layout_refusal(lora: LoRAConfig | None, layout: Any) -> Refusal | None:
    """How a quantised base (``nf4``) refuses ``layout`` (a ``disttrain.parallel.layout.Layout``), or None where it
    runs there: one process or DDP only. FSDP2 and tensor parallelism hold parameters as DTensors, which
    bitsandbytes' 4-bit weights are not; pipeline stages, context and expert parallelism, ZeRO-1 and the kinds of
    run that exchange updates themselves are untested with them. The one rule of the base's dtype against a layout:
    validation raises its error for the run's layout, and ``parallel=auto`` weighs only the candidates it leaves."""
    if lora is None or not lora.quantises_base:
        return None
    plain = (layout.wrapper in ("none", "ddp") and layout.ddp_exchange and not layout.shards_optimizer_state
             and layout.tp == 1 and layout.cp == 1 and layout.ep == 1)
    if plain:
        return None
    return Refusal("model.lora.base_dtype", lora.base_dtype, "keep or bfloat16",
                   f"with {layout.describe()}; nf4 runs on one process or under parallel=ddp (bitsandbytes' 4-bit "
                   "weights are not sharded or split)",
                   "layouts other than one process or DDP (bitsandbytes' 4-bit weights are not sharded or split)")


def check_base_layout(lora: LoRAConfig | None, layout: Any) -> None:
    """Raise the error of ``base_layout_refusal`` where the base's dtype refuses the run's own layout."""
    refusal = base_layout_refusal(lora, layout)
    if refusal is not None:
        raise refusal.error()
