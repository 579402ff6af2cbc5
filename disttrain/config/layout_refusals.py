"""The run's settings that refuse parallel layouts, as one rule (``LayoutRefusals``): the compile settings
(``trainer_checks.compile_refusal``), a quantised LoRA base (``lora.base_layout_refusal``), a gradient codec
(``CommConfig.layout_refusal``), an optimiser that exchanges over the ranks itself (1-bit Adam's
``layout_refusal``) and torchft's replica groups (``torchft_checks.torchft_layout_refusal``). Each rule lives
beside its setting; validation raises their refusal of the run's own layout, and ``parallel=auto`` weighs only the
candidates they leave (``disttrain.plan.planner.weigh_layouts``), so the planner never chooses a layout the run
would then refuse."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from disttrain.config.torchft_checks import torchft_layout_refusal
from disttrain.config.trainer_checks import compile_refusal
from disttrain.errors import Refusal
from disttrain.models.lora import base_layout_refusal
from disttrain.parallel.compile import Compilation
from disttrain.parallel.layout import Layout


@dataclass(frozen=True)
class LayoutRefusals:
    """The settings of one run that may refuse a layout, each rule living beside its setting."""

    compilation: Compilation | None
    """The run's compilation (``TrainerConfig.compilation``; None: eager)."""
    lora: Any = None
    """The model's ``LoRAConfig`` (None: a model without adapters)."""
    comm: Any = None
    """The run's ``CommConfig`` (None: gradients sent as DDP or FSDP2 send them)."""
    optim: Any = None
    """The run's optimiser config; one with a ``layout_refusal`` (1-bit Adam) refuses layouts itself."""
    fault_engine: str = "restart"
    """``fault_tolerance.engine``: torchft's replica groups refuse layouts."""

    @classmethod
    def of(cls, top: Any, model: Any, optim: Any) -> LayoutRefusals:
        """The refusing settings of a run: ``top`` its ``TrainConfig``, ``model`` and ``optim`` its groups."""
        return cls(top.trainer.compilation, getattr(model, "lora", None), top.comm, optim,
                   top.fault_tolerance.engine)

    def refusal(self, layout: Layout, accumulation: int) -> Refusal | None:
        """The first setting that refuses ``layout`` with ``accumulation`` micro-batches a step, None where every
        one allows it. The compile settings are asked first: their refusal says what runs the mode instead."""
        optimiser_rule = getattr(self.optim, "layout_refusal", None)
        return (compile_refusal(self.compilation, layout, accumulation)
                or base_layout_refusal(self.lora, layout)
                or (self.comm.layout_refusal(layout) if self.comm is not None else None)
                or (optimiser_rule(layout) if optimiser_rule is not None else None)
                or torchft_layout_refusal(self.fault_engine, layout))

    def of_candidate(self, candidate: Any) -> Refusal | None:
        """``refusal`` of a planner's candidate (``disttrain.plan.layout.Layout``), with its own accumulation: the
        function ``parallel=auto`` is handed."""
        return self.refusal(candidate, candidate.accumulation)

    def check(self, layout: Layout, accumulation: int) -> None:
        """Raise the error of ``refusal`` where a setting refuses the run's own layout."""
        refusal = self.refusal(layout, accumulation)
        if refusal is not None:
            raise refusal.error()
