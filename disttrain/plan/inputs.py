"""What a plan of one run needs besides its layout: the measured model, the bytes of its state, the
precision and the hardware, so that ``parallel=auto`` can estimate every candidate layout from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from disttrain.plan.devices import HardwareProfile
from disttrain.plan.estimate import Estimate, estimate
from disttrain.plan.layout import Layout, StateBytes
from disttrain.plan.model_stats import ModelStats

if TYPE_CHECKING:
    from disttrain.parallel.float8 import Float8Layers


@dataclass
class PlanInputs:
    """What a plan needs besides the layout: the measured model, the state bytes, precision and profile."""

    stats: ModelStats
    """The model at one micro-batch (activations and FLOPs scale with the layout's micro-batch)."""
    state: StateBytes
    """Bytes per parameter element of model state."""
    bf16: bool
    """bf16-mixed precision (activations and compute in bf16)."""
    profile: HardwareProfile
    """The hardware predicted for."""
    has_tp_plan: bool
    """The model (or config) declares a tensor-parallel plan."""
    num_heads: int | None = None
    """Attention heads, where the model says (tp must divide them)."""
    measure: Any = None
    """Callable micro-batch size -> ModelStats (passes are cached per size)."""
    float8: Float8Layers | None = None
    """The linear layers that train in float8 (``trainer.fp8``, as validation decided; None: none)."""
    _cache: dict[int, ModelStats] = field(default_factory=dict)
    """Passes already measured, by micro-batch size."""

    def stats_for(self, micro_size: int) -> ModelStats:
        """The model measured at ``micro_size`` (operator costs do not scale linearly: weights are read once)."""
        if self.measure is None or micro_size == self.stats.micro_size:
            return self.stats
        if micro_size not in self._cache:
            self._cache[micro_size] = self.measure(micro_size)
        return self._cache[micro_size]

    def estimate(self, layout: Layout) -> Estimate:
        """The prediction for ``layout``, from a pass at its micro-batch (per pipeline microbatch)."""
        size = max(1, layout.micro_size // (layout.microbatches if layout.pp > 1 else 1))
        return estimate(self.stats_for(size), layout, self.profile, self.state, self.bf16, self.float8)
