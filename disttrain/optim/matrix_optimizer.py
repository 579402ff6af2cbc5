"""One optimiser for a run that steps its matrices whole (Muon, SOAP) and every other parameter with AdamW: the
groups whose ``matrix_key`` is true go to the subclass's ``matrix_step``, the rest to torch's AdamW on their local
shards, so ZeRO-1, the schedule and checkpoints see one optimiser."""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim.adam import adam

from disttrain.models.heads import HeadBlocks
from disttrain.optim.matrices import whole
from disttrain.optim.norms import local
from disttrain.optim.stepping import closure_and_grads


class MatrixOptimizer(torch.optim.Optimizer, abc.ABC):
    """Matrices (2-D parameters, and 3-D stacks of them: MoE experts) of the groups with ``matrix_key`` true are
    stepped by ``matrix_step``; the other groups take torch's AdamW step (``betas``, ``weight_decay`` and the
    epsilon under ``adamw_eps_key``). A subclass with ``shard_local = True`` steps each local shard of a matrix
    instead of the whole: wrong on purpose, so the parity tests can show they catch it (a class attribute, not a
    constructor argument: ZeRO-1 would carry one into the param groups and so into checkpoints).

    A group of attention projections stepped per head carries ``head_axis`` and ``head_width`` (a ``HeadBlocks``,
    see ``disttrain.models.heads``): its group keys, so ZeRO-1's rebuilt optimiser and checkpoints keep them."""

    matrix_key = "matrix"
    """The param-group key that marks the groups of matrices (True) and of AdamW's parameters (False)."""
    adamw_eps_key = "eps"
    """The param-group key of AdamW's epsilon."""
    shard_local = False
    """Step each local shard rather than the whole matrix (the deliberate mistake of the parity tests)."""

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], defaults: dict[str, Any]) -> None:
        if not defaults["lr"] >= 0:
            raise ValueError(f"invalid learning rate {defaults['lr']}")
        super().__init__(params, {**defaults, self.matrix_key: True})
        self.gathered_bytes = 0
        """Bytes this rank has received, since it was built, to make its split matrices whole (``gather_whole``)."""
        for group in self.param_groups:
            if group[self.matrix_key] and any(p.ndim not in (2, 3) for p in group["params"]):
                raise ValueError(f"{type(self).__name__} steps matrices (2-D) and stacks of matrices (3-D) only")
            if self.head_blocks(group) and any(p.ndim != 2 for p in group["params"]):
                raise ValueError(f"{type(self).__name__} steps the heads of 2-D attention projections only")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One step: ``matrix_step`` on the matrices, AdamW on the rest, over the parameters that have a gradient."""
        loss, grads = closure_and_grads(self, closure)
        adamw: dict[int, tuple[dict[str, Any], list[tuple[Tensor, Tensor]]]] = {}
        for group, p, g in grads:
            if group[self.matrix_key]:
                self.matrix_step(group, p, g)
            else:
                adamw.setdefault(id(group), (group, []))[1].append((p, g))
        for group, items in adamw.values():
            self._adamw_step(group, items)
        return loss

    @abc.abstractmethod
    def matrix_step(self, group: dict[str, Any], p: Tensor, g: Tensor) -> None:
        """Step the matrix (or stack of matrices) ``p`` of ``group`` with its local gradient ``g``."""

    def gather_whole(self, local_tensor: Tensor, p: Tensor) -> Tensor:
        """``matrices.whole(local_tensor, p)``, its bytes counted in ``gathered_bytes``: what this rank did not
        hold (the whole less its own shard), which over a ring all-gather is also what each rank sends."""
        full = whole(local_tensor, p)
        if full is not local_tensor:
            self.gathered_bytes += (full.numel() - local_tensor.numel()) * full.element_size()
        return full

    @staticmethod
    def head_blocks(group: dict[str, Any]) -> HeadBlocks | None:
        """The heads of ``group``'s attention projections, each stepped as its own matrix (None: whole matrices)."""
        if group.get("head_axis") is None:
            return None
        return HeadBlocks(group["head_axis"], group["head_width"])

    def _adamw_step(self, group: dict[str, Any], items: list[tuple[Tensor, Tensor]]) -> None:
        """torch's AdamW step (its functional form) of ``group``'s parameters on their local shards: elementwise, so
        a shard steps as the whole parameter would."""
        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        for p, g in items:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(local(p))
            grads.append(g)
            exp_avgs.append(local(state["exp_avg"]))
            exp_avg_sqs.append(local(state["exp_avg_sq"]))
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, decoupled_weight_decay=True, amsgrad=False,
             beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
             eps=group[self.adamw_eps_key], maximize=False)
