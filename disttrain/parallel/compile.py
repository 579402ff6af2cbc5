"""``trainer.compile``: torch.compile applied to the model in place, after the parallel layout is set up.

Compiled in place (``nn.Module.compile``), so parameter names, checkpoints and exports stay those of the
eager model. Under FSDP2 or tensor parallelism each unit (transformer block) is compiled on its own, as
their hooks sit between the units; elsewhere the whole model is one graph.
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


def compile_model(model: nn.Module, units: list[nn.Module], per_unit: bool, mode: str = "default") -> None:
    """Compile ``model`` in place in torch.compile's ``mode``: each of ``units`` on its own when ``per_unit`` (and
    there are any), else whole."""
    for module in units if per_unit and units else [model]:
        module.compile(mode=torch_compile_mode(mode))
