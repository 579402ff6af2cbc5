"""Megatron-style tensor parallelism from a model's plan (``torch.distributed.tensor.parallel``).

A plan maps module-name patterns to styles (``disttrain.models.protocol``). ``colwise`` layers hold a slice
of the output features on each tp rank, ``rowwise`` layers a slice of the input features, and their partial
outputs are summed by one all-reduce per sub-layer (forward and backward). For a transformer block: q, k, v
and the first MLP layer column-wise, the output projections row-wise, so each rank holds ``n_head / tp``
heads. Modules the plan does not name stay replicated; their gradients are complete and equal on all tp
ranks, because the sharded layers all-reduce the gradient flowing back into the replicated activations.

``colwise_gather`` and ``rowwise_whole_input`` are the same splits with whole activations between them: the
column-wise layer gathers its output, the row-wise one takes a whole input and uses its own slice (for models
that apply a norm over all heads, or view a fused projection, between the two). ``experts`` and ``mla_kv_a`` are
in ``disttrain.parallel.tp_styles``.

With ``sequence_parallel`` the residual stream between the sharded layers is split along the sequence
(dim 1): ``sequence_norm`` modules run on the local tokens, ``sequence_gather`` modules all-gather their
input, row-wise layers reduce-scatter their output, and the ``sequence_split`` module's output is split.
Without it those three styles do nothing.

All tp ranks must see the same batch. Dropout masks are drawn per rank; for exact replication keep
dropout at 0 or seed the tp ranks alike.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from disttrain.errors import ConfigError
from disttrain.models.lora import adapter_parts, uses_dora
from disttrain.models.protocol import TP_STYLES
from disttrain.parallel.model_plan import matching_modules
from disttrain.parallel.tp_styles import ExpertsParallel, MlaKvAParallel

SEQUENCE_STYLES = ("sequence_norm", "sequence_gather", "sequence_split")
"""Styles that apply only with sequence parallelism."""
SPLIT_STYLES = ("colwise", "rowwise", "colwise_gather", "rowwise_whole_input")
"""Styles that split a linear layer's weight (a LoRA layer wrapping one gets ``adapter_styles``)."""


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, plan: dict[str, str], sequence_parallel: bool = False
             ) -> nn.Module:
    """Shard ``model`` in place over the 1-D ``tp_mesh`` by ``plan`` and return it; build the optimiser after.

    Patterns that match no module are skipped, so the plan of a whole model also applies to a pipeline
    stage that holds part of it (under the same names).
    """
    styles: dict[str, ParallelStyle | None] = {}
    for pattern, style in plan.items():
        for name in matching_modules(model, pattern):
            module = model.get_submodule(name)
            parts = adapter_parts(module)
            if parts is not None and style in SPLIT_STYLES:
                styles.update(adapter_styles(name, parts, style, sequence_parallel))
            else:
                styles[name] = style_of(style, type(module), sequence_parallel, _rope_width(model, name))
    frozen = {name for name, param in model.named_parameters() if not param.requires_grad}
    parallelize_module(model, tp_mesh, {name: style for name, style in styles.items() if style is not None})
    # torch's SequenceParallel registers its replicated parameters as new trainable ones: frozen ones stay frozen
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    return model


def adapter_styles(name: str, parts: tuple[str, str, str], style: str, sequence_parallel: bool
                   ) -> dict[str, ParallelStyle | None]:
    """The styles of a LoRA layer whose wrapped layer the plan splits by ``style``, as Megatron and torchtitan
    split adapters: the adapter's output is added to the wrapped layer's, so it must be laid out alike.

    A column-wise layer's adapter keeps its down projection whole (its input is the layer's whole input) and
    splits its up projection's output features as the layer's. A row-wise layer's input arrives split by
    features: the down projection is split by its input features as the layer is, its partial outputs summed
    (reduce-scattered along the sequence with sequence parallelism), and the up projection is whole; on a
    sequence slice its weight is a replicated DTensor, so its gradient is summed over the tp ranks."""
    base, down, up = parts
    split = style_of(style, nn.Linear, sequence_parallel)
    if style.startswith("colwise"):
        return {f"{name}.{base}": split, f"{name}.{up}": style_of(style, nn.Linear, sequence_parallel)}
    return {f"{name}.{base}": split, f"{name}.{down}": style_of(style, nn.Linear, sequence_parallel),
            f"{name}.{up}": SequenceParallel(use_local_output=True) if sequence_parallel else None}


def style_of(style: str, module_type: type, sequence_parallel: bool, rope_width: int | None = None
             ) -> ParallelStyle | None:
    """The DTensor parallel style of a plan entry (None: nothing to do without sequence parallelism);
    ``rope_width``: the shared rotary key's width, for ``mla_kv_a``."""
    seq = Shard(1)
    if style == "colwise":
        return ColwiseParallel()
    if style == "colwise_gather":
        return ColwiseParallel(output_layouts=Replicate())
    if style in ("rowwise", "rowwise_whole_input"):
        # an embedding split by rows (the vocabulary) takes whole token ids as its input
        whole = style == "rowwise_whole_input" or issubclass(module_type, nn.Embedding)
        return RowwiseParallel(input_layouts=Replicate() if whole else Shard(-1),
                               output_layouts=seq if sequence_parallel else Replicate())
    if style == "experts":
        return ExpertsParallel()
    if style == "mla_kv_a":
        return MlaKvAParallel(rope_width)
    if style == "per_head":
        # whole weights as replicated DTensors over this rank's heads (dim 2 of [B, T, heads, head_dim]): autograd
        # sums their partial gradients over the tp ranks, as torch's sequence-parallel norms do over tokens
        return SequenceParallel(sequence_dim=2, use_local_output=True)
    if style not in SEQUENCE_STYLES:
        raise ValueError(f"unknown tensor-parallel style {style!r}: one of {list(TP_STYLES)}")
    if not sequence_parallel:
        return None
    if style == "sequence_norm":
        return SequenceParallel()
    if style == "sequence_gather":
        return PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True)
    return PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=seq)


def check_tp_plan(model: nn.Module, plan: dict[str, str], tp: int, sequence_parallel: bool, source: str) -> None:
    """ConfigError unless ``plan`` names modules of ``model`` with known styles that split ``tp`` ways.

    ``source`` says where the plan came from (the model's ``tp_plan()`` or ``parallel.tp_plan``), for messages.
    """
    sizes = getattr(model, "tp_sizes", None)
    for key, size in (sizes() if callable(sizes) else {}).items():
        if size % tp:
            raise ConfigError(key, size, f"divisible by parallel.tp={tp}")
    for pattern, style in plan.items():
        if style not in TP_STYLES:
            raise ConfigError(f"{source}[{pattern}]", style, f"one of {list(TP_STYLES)}")
        names = matching_modules(model, pattern)
        if not names:
            raise ConfigError(f"{source}[{pattern}]", style, f"a pattern that matches modules of "
                              f"{type(model).__name__} (it matches none)")
        for name in names:
            module = model.get_submodule(name)
            if adapter_parts(module) is not None and style in SPLIT_STYLES:
                if uses_dora(module):
                    raise ConfigError("model.lora.dora", True, f"false with parallel.tp={tp}: DoRA's magnitudes are "
                                      f"norms of whole weight rows, which {name} ({style}) splits")
                module = module.get_submodule(adapter_parts(module)[0])
            if style in SPLIT_STYLES:
                _check_split(module, name, style.split("_")[0], tp)
            elif style == "experts":
                _check_experts(module, name, tp)
            elif style == "mla_kv_a" and (not isinstance(module, nn.Linear) or _rope_width(model, name) is None):
                raise ConfigError(f"{source}[{pattern}]", style, f"mla_kv_a only on an nn.Linear inside an attention "
                                  f"module with a qk_rope_head_dim; {name} is a {type(module).__name__} in one without")
    if sequence_parallel and "sequence_split" not in plan.values():
        raise ConfigError("parallel.sequence_parallel", True, f"false: {source} has no sequence_split entry (the "
                          "module whose output the sequence is split after), so it has no sequence-parallel plan")


def _check_split(module: nn.Module, name: str, style: str, tp: int) -> None:
    if isinstance(module, nn.Linear):
        features, what = (module.out_features, "output") if style == "colwise" else (module.in_features, "input")
    elif isinstance(module, nn.Embedding):
        features, what = (module.embedding_dim, "embedding") if style == "colwise" else (module.num_embeddings, "row")
    else:
        raise ConfigError("parallel.tp_plan", f"{name}: {style}", f"{style} only on nn.Linear or nn.Embedding "
                          f"modules; {name} is a {type(module).__name__}")
    if features % tp:
        raise ConfigError("parallel.tp", tp, f"a divisor of the {features} {what} features of {name} ({style})")


def _check_experts(module: nn.Module, name: str, tp: int) -> None:
    n_experts = getattr(module, "num_experts", None)
    params = dict(module.named_parameters(recurse=False))
    if not isinstance(n_experts, int) or not params or any(p.size(0) != n_experts for p in params.values()):
        raise ConfigError("parallel.tp_plan", f"{name}: experts", "experts only on a module with a num_experts "
                          f"attribute whose own parameters are all [num_experts, ...]; {name} is a "
                          f"{type(module).__name__} that is not one")
    if n_experts % tp:
        raise ConfigError("parallel.tp", tp, f"a divisor of the {n_experts} experts of {name} (each tp rank holds "
                          "whole experts)")


def _rope_width(model: nn.Module, name: str) -> int | None:
    """The shared rotary key's width of the attention module around ``name`` (None: it has none)."""
    parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
    width = getattr(parent, "qk_rope_head_dim", None)
    return width if isinstance(width, int) else None
