"""``trainer.compile``: torch.compile applied to the model in place, after the parallel layout is set up.

Compiled in place (``nn.Module.compile``), so parameter names, checkpoints and exports stay those of the
eager model. What is compiled is the run's ``Compilation``, decided once from the config
(``TrainerConfig.compilation``) and handed down whole:

- scope ``blocks`` (the default): each unit (transformer block, ``shard_units_of``) on its own, under every
  layout. The blocks of a model run one compiled code (dynamo guards on a block's structure, not on its
  parameters), so what is traced and compiled is one block's whatever the depth, and FSDP2's and tensor
  parallelism's hooks sit between units. The modules outside the units (embedding, final norm, head) run eager.
- scope ``model``: the whole model as one graph, for a small model whose short step the per-region host time
  (guards, one autograd wrapper per block) holds back; not under FSDP2, whose hooks on every unit dynamo does not
  trace (``disttrain.config.trainer_checks``).

The whole model is also one graph where it has no units, and under the modes that record CUDA graphs, whatever
the scope. The loss is compiled on its own (``disttrain.rank.loss``). ``benchmarks/compile_regions.py`` measures
the two scopes side by side with this module's own ``compile_model`` (its figures: ``benchmarks/README.md``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""torch.compile's modes (``trainer.compile_mode``)."""
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
"""The modes that record CUDA graphs on a GPU: a compiled region's outputs live in the graph's memory, which
its next replay writes over."""
COMPILE_SCOPES = ("blocks", "model")
"""What ``trainer.compile`` compiles as one region (``trainer.compile_scope``): each block, or the whole model."""


@dataclass(frozen=True)
class Compilation:
    """How a run compiles its model: torch.compile's ``mode`` (``COMPILE_MODES``) and the ``scope`` of one
    compiled region (``COMPILE_SCOPES``)."""

    mode: str = "default"
    """torch.compile's mode, as ``trainer.compile_mode`` names it."""
    scope: str = "blocks"
    """``blocks``: each transformer block on its own; ``model``: the whole model as one graph."""

    @property
    def whole_model(self) -> bool:
        """Whether the model is compiled as one region whatever its blocks: scope ``model``, or a mode that
        records CUDA graphs (one graph replayed per forward and backward rather than one per block, each
        recorded again for its block's parameter addresses; those modes run on one rank without sharding,
        ``disttrain.config.trainer_checks``)."""
        return self.scope == "model" or self.mode in CUDA_GRAPH_MODES


def torch_compile_mode(mode: str) -> str | None:
    """``trainer.compile_mode`` as ``torch.compile``'s ``mode`` argument (None is its default)."""
    return None if mode == "default" else mode


def compiled_regions(model: nn.Module, units: list[nn.Module], compilation: Compilation) -> list[nn.Module]:
    """The modules that ``trainer.compile`` compiles, each on its own: the ``units`` (the model's blocks), or the
    whole ``model`` when it has none or ``compilation`` takes it whole (``Compilation.whole_model``)."""
    return [model] if compilation.whole_model or not units else list(units)


def compile_model(model: nn.Module, units: list[nn.Module], compilation: Compilation) -> None:
    """Compile ``model`` in place as ``compilation`` says (its mode; its regions: ``compiled_regions``)."""
    for module in compiled_regions(model, units, compilation):
        module.compile(mode=torch_compile_mode(compilation.mode))
