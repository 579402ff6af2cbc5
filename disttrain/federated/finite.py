"""Non-finite global models: how a round finds one, and the state that a dropped round goes back to.

The global model is the same on every rank after a round (the aggregate is all-reduced and every rank takes
the same server step), so each rank reads the same verdict and acts alike without a collective of its own.
"""

from __future__ import annotations

import torch

from disttrain.federated.client import copy_state


def first_non_finite(tensors: list[torch.Tensor]) -> float | None:
    """A non-finite value of ``tensors`` (nan, inf or -inf), or None where every value is finite.

    One host read per call where all are finite: the model's values are checked on their device, and only the
    verdict comes back."""
    if not tensors:
        return None
    finite = torch.stack([torch.isfinite(t).all() for t in tensors])
    if bool(finite.all()):
        return None
    bad = tensors[int(torch.nonzero(~finite)[0])].detach().reshape(-1)
    return float(bad[~torch.isfinite(bad)][0])


class RoundSnapshot:
    """The global model's trained parameters and float buffers, and the server optimiser's state, as they were
    before a round: what ``fault_tolerance.nan_policy=skip`` restores to drop the round's update."""

    def __init__(self, tensors: list[torch.Tensor], optimizer: torch.optim.Optimizer, round_number: int) -> None:
        self.round = round_number
        """The round (from 1) whose update ``restore`` drops."""
        self._targets = tensors
        self._values = [t.detach().clone() for t in tensors]
        self._optimizer = optimizer
        # a copy of each state tensor: the server step updates its moments in place
        self._state = {param: {key: value.clone() if isinstance(value, torch.Tensor) else value
                               for key, value in state.items()}
                       for param, state in optimizer.state.items()}

    def restore(self) -> None:
        """Put the model and the optimiser state back as they were (a first round's moments: none again)."""
        copy_state(self._values, self._targets)
        self._optimizer.state.clear()
        self._optimizer.state.update(self._state)
