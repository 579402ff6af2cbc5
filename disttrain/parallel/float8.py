"""``trainer.fp8``: float8 training of the model's linear layers through torchao (``torchao.float8``).

Which layers train in float8 is decided once, before any rank starts (``choose_float8_layers``), and handed to
every rank as ``Float8Layers``: the linear layers whose two dimensions are multiples of 16 (what float8 matrix
products take), except the output head (its logits feed the loss directly, as torchtitan and Megatron leave it)
and layers outside ``trainer.fp8_layers``' patterns. The rank swaps exactly those for torchao's ``Float8Linear``
before its layout is applied (``convert_to_float8``): parameter names, checkpoints and exports stay the linear
layers' own. Under ZeRO-2/3 and HSDP, with the tensorwise recipe, FSDP2 gathers those weights in float8 (half the
bytes of bf16), each scaled by the amax of the whole weight: taken for all of them at once after each optimiser step
(``Float8Layers.after_optimizer_step``), dropped when a load replaces the weights (``after_weights_replaced``).

On a CPU, torch's float8 products run too (slower than bf16 here): a run can be checked before it takes a GPU.
On a GPU they need compute capability 8.9 or more (Ada, Hopper and later).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from disttrain.errors import ConfigError
from disttrain.quiet_imports import quiet_imports

FP8_RECIPES = ("none", "tensorwise", "rowwise")
"""``trainer.fp8``: off, or torchao's recipe: one scale per tensor (tensorwise) or per row (rowwise)."""
MULTIPLE = 16
"""Float8 matrix products take dimensions that are multiples of this."""
HEAD_NAMES = ("lm_head", "output", "head", "classifier", "score")
"""A module's last name part that marks a model's output head, left in the run's precision."""
MIN_CAPABILITY = (8, 9)
"""The CUDA compute capability float8 matrix products need (Ada, Hopper and later)."""


@dataclass(frozen=True)
class Float8Layers:
    """The run's float8 decision, made once before ranks start: the recipe, the linear layers swapped (module
    names of the unwrapped model) and whether FSDP2 gathers their weights in float8."""

    recipe: str
    """torchao's recipe: tensorwise or rowwise."""
    modules: tuple[str, ...]
    """The linear layers trained in float8."""
    all_gather: bool
    """FSDP2 gathers these weights in float8 (tensorwise recipe, sharded parameters)."""

    def after_optimizer_step(self, net: nn.Module) -> None:
        """Where FSDP2 gathers these weights in float8, take every weight's scale (float8's largest value over the
        amax of the whole weight) in one pass: one fused norm over the local shards and one all-reduce (torchao's
        ``precompute_float8_dynamic_scale_for_fsdp``). Each scale is kept on its weight's local shard, and the
        gathers of forward, backward and evaluation use it until the weights change again. Without it each gather
        takes its own weight's amax, a reduction and an all-reduce per weight and per gather, through a tensor
        subclass's Python dispatch."""
        if not self.all_gather:
            return
        with quiet_imports():
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        precompute_float8_dynamic_scale_for_fsdp(net)

    def after_weights_replaced(self, net: nn.Module) -> None:
        """Where FSDP2 gathers these weights in float8, drop the scales taken for the weights that a load has just
        replaced (a checkpoint, a live replica group's state): the gathers then take each loaded weight's amax
        themselves, as on the first step, until the next optimiser step takes the scales again. No collective: a
        rank may call it alone."""
        if not self.all_gather:
            return
        for weight in gathered_float8_weights(net):
            weight._precomputed_scale = None  # torchao's field; tests/test_float8.py reads it under this name


def gathered_float8_weights(net: nn.Module) -> list[Any]:
    """The local shards of ``net``'s weights that FSDP2 gathers in float8 (torchao's float8-casting tensors),
    each carrying the scale taken after the last optimiser step, if any, as ``_precomputed_scale``."""
    from torch.distributed.tensor import DTensor  # here: the job process, which validates, never imports it

    with quiet_imports():
        from torchao.float8.float8_linear import Float8Linear
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    # the DTensor's own local tensor, where torchao keeps the scale: to_local() hands out a new alias of it
    return [module.weight._local_tensor for module in net.modules()
            if isinstance(module, Float8Linear) and isinstance(module.weight, DTensor)
            and isinstance(module.weight._local_tensor, WeightWithDynamicFloat8CastTensor)]


def float8_layer_choice(net: nn.Module, patterns: list[str] | None) -> tuple[list[str], list[tuple[str, str]]]:
    """``(swapped, left)``: the linear layers of ``net`` that train in float8, and each other linear layer with why it
    stays in the run's precision. ``patterns`` (fnmatch, ``trainer.fp8_layers``): the layers eligible (None: all)."""
    swapped, left = [], []
    for name, module in net.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        out_features, in_features = module.weight.shape
        if name.split(".")[-1] in HEAD_NAMES:
            left.append((name, "the output head"))
        elif patterns is not None and not any(fnmatch.fnmatchcase(name, p) for p in patterns):
            left.append((name, "not in trainer.fp8_layers"))
        elif in_features % MULTIPLE or out_features % MULTIPLE:
            left.append((name, f"{out_features}x{in_features}, not multiples of {MULTIPLE}"))
        else:
            swapped.append(name)
    return swapped, left


def choose_float8_layers(net: nn.Module, recipe: str, patterns: list[str] | None, all_gather: bool,
                         shards_parameters: bool, precision: str) -> tuple[Float8Layers, str]:
    """The run's ``Float8Layers`` for ``net`` (on the meta device) and the line that says what trains in float8 and
    what does not; a ConfigError when no layer would."""
    swapped, left = float8_layer_choice(net, patterns)
    if not swapped:
        raise ConfigError("trainer.fp8_layers" if patterns is not None else "trainer.fp8", patterns or recipe,
                          f"patterns that name linear layers whose dimensions are multiples of {MULTIPLE}: none of "
                          f"the model's {len(left)} linear layers qualifies "
                          f"({', '.join(f'{n}: {why}' for n, why in left[:4])})")
    gathers = all_gather and shards_parameters and recipe == "tensorwise"
    params = sum(net.get_submodule(n).weight.numel() for n in swapped)
    total = sum(net.get_submodule(n).weight.numel() for n in swapped + [n for n, _ in left])
    kept = "; ".join(f"{n} ({why})" for n, why in left) or "none"
    gathered = f", their weights gathered in {'float8' if gathers else precision_name(precision)}" \
        if shards_parameters else ""
    line = (f"trainer.fp8={recipe}: {len(swapped)} linear layers in float8 ({100 * params / total:.1f}% of the "
            f"linear weights){gathered}; left in {precision_name(precision)}: {kept}")
    return Float8Layers(recipe, tuple(swapped), gathers), line


def precision_name(precision: str) -> str:
    """The dtype a Lightning precision computes the other layers in."""
    return "bf16" if precision.startswith("bf16") else "fp32" if precision.startswith("32") else precision


def check_float8_device(uses_gpu: bool, capability: tuple[int, int] | None) -> None:
    """Refuse ``trainer.fp8`` on a GPU without float8 matrix products (``capability``: the GPU's, None: unknown)."""
    if uses_gpu and capability is not None and capability < MIN_CAPABILITY:
        raise ConfigError("trainer.fp8", "on a GPU of compute capability " + ".".join(map(str, capability)),
                          "none: float8 matrix products need compute capability 8.9 or more (Ada, Hopper and later)")


def require_torchao() -> None:
    """Raise a ConfigError naming the extra to install when torchao is missing."""
    try:
        with quiet_imports():
            import torchao.float8  # noqa: F401
    except ImportError:
        raise ConfigError("trainer.fp8", "tensorwise or rowwise", "none, or install torchao (pip install "
                          "'disttrain[fp8]')") from None


def convert_to_float8(net: nn.Module, layers: Float8Layers) -> None:
    """Swap ``layers.modules`` of ``net`` for torchao's ``Float8Linear`` in place (before its layout is applied)."""
    with quiet_imports():
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(layers.recipe)
    if layers.all_gather:
        config = replace(config, enable_fsdp_float8_all_gather=True)
    names = set(layers.modules)
    convert_to_float8_training(net, config=config, module_filter_fn=lambda _, name: name in names)
