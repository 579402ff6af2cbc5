"""``trainer.compile``: torch.compile applied to the model in place, after the parallel layout is set up.

Compiled in place (``nn.Module.compile``), so parameter names, checkpoints and exports stay those of the
eager model. Each unit (transformer block, ``shard_units_of``) is compiled on its own under every layout: the
blocks of a model run one compiled code (dynamo guards on a block's structure, not on its parameters), so what
is traced and compiled is one block's whatever the depth, and FSDP2's and tensor parallelism's hooks sit between
units. The modules outside the units (embedding, final norm, head) run eager; the loss is compiled on its own
(``disttrain.rank.loss``). Measured against one graph of the whole model by ``benchmarks/compile_regions.py``
(its figures: ``benchmarks/README.md``). The whole model is one graph where it has no units, and under the modes
that record CUDA graphs.
"""

from __future__ import annotations

from torch import nn

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""torch.compile's modes (``trainer.compile_mode``)."""
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
"""The modes that record CUDA graphs on a GPU: a compiled region's outputs live in the graph's memory, which
its next replay writes over."""


def torch_compile_mode(mode: str) -> str | None:
    """``trainer.compile_mode`` as ``torch.compile``'s ``mode`` argument (None is its default)."""
    return None if mode == "default" else mode


def compiled_regions(model: nn.Module, units: list[nn.Module], mode: str = "default") -> list[nn.Module]:
    """The modules that ``trainer.compile`` compiles, each on its own: the ``units`` (the model's blocks), or the
    whole ``model`` when it has none, or in a mode that records CUDA graphs (one graph replayed per forward and
    backward rather than one per block, each recorded again for its block's parameter addresses; those modes run
    on one rank without sharding, ``disttrain.config.trainer_checks``)."""
    return list(units) if units and mode not in CUDA_GRAPH_MODES else [model]


def compile_model(model: nn.Module, units: list[nn.Module], mode: str = "default") -> None:
    """Compile ``model`` in place in torch.compile's ``mode``, as ``compiled_regions`` says."""
    for module in compiled_regions(model, units, mode):
        module.compile(mode=torch_compile_mode(mode))
