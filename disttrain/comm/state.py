"""Per-rank state of the gradient exchange, kept in checkpoints so a resumed run continues the same
compression (DeepSpeed resets its error-feedback residuals on load)."""

from __future__ import annotations

from typing import Any

from disttrain.comm.exchange import ErrorFeedback
from disttrain.comm.powersgd import PowerSGDExchange
from disttrain.fault.per_rank import PerRankState


class ExchangeState:
    """What this rank's gradient exchange carries from one step to the next."""

    def __init__(self) -> None:
        self.feedback = ErrorFeedback()
        """Error-feedback residuals of the int8 and onebit codecs."""
        self.powersgd: PowerSGDExchange | None = None
        """PowerSGD's step count, residual and warm-started factors (``comm=powersgd``)."""
        self.exchanges = 0
        """Gradient exchanges so far, one per optimiser step: the fp32 warm-up lasts while it is below
        ``comm.warmup_steps``."""

    def state_dict(self) -> dict[str, Any]:
        """Plain data and CPU tensors."""
        state: dict[str, Any] = {"exchanges": self.exchanges,
                                 "residuals": {key: value.cpu() for key, value in self.feedback.residuals.items()}}
        if self.powersgd is not None:
            state["powersgd"] = {key: value.cpu() if hasattr(value, "cpu") else value
                                 for key, value in self.powersgd.state_dict().items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict``'s output."""
        self.exchanges = int(state.get("exchanges", 0))
        self.feedback.residuals = dict(state.get("residuals", {}))
        if self.powersgd is not None and "powersgd" in state:
            self.powersgd.load_state_dict(state["powersgd"])


class ExchangeStateCheckpoint(PerRankState):
    """Every rank's exchange state in the checkpoint; on another world size the run keeps only the exchange
    count (which rank owns which chunk, and so the residuals, follow the world size)."""

    def __init__(self, state: ExchangeState) -> None:
        self.state = state

    def own_state(self) -> dict[str, Any]:
        """This rank's exchange state."""
        return self.state.state_dict()

    def restore(self, state: dict[str, Any], same_world: bool) -> None:
        """Take the checkpoint's exchange state back on the same world size."""
        if same_world:
            self.state.load_state_dict(state)
        else:
            self.state.exchanges = int(state.get("exchanges", 0))
