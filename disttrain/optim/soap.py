"""SOAP (Vyas et al., 2024: Shampoo's eigenbasis with Adam run inside it) for the hidden matrices, AdamW for every
other parameter, each matrix preconditioned whole under every layout."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from disttrain import checks
from disttrain.errors import ConfigError
from disttrain.models.heads import from_heads, to_heads
from disttrain.optim.matrices import shard_of
from disttrain.optim.matrix_optimizer import MatrixOptimizer
from disttrain.optim.muon import MuonOthers, matrix_groups, route, routing_lines
from disttrain.optim.norms import local
from disttrain.optim.registry import OPTIMIZERS


class Soap(MatrixOptimizer):
    """SOAP for the groups with ``soap=True``, torch's AdamW for the others, in one optimiser (so ZeRO-1, the schedule
    and checkpoints see one optimiser).

    Per matrix ``W`` with whole gradient ``G`` at step ``t`` (a 3-D parameter ``[E, rows, cols]`` is ``E`` matrices,
    an MoE expert stack), with ``beta1, beta2 = betas``::

        t = 1:  only the preconditioners: L = (1 - beta2) G Gᵀ, R = (1 - beta2) Gᵀ G, QL, QR = eigh(L), eigh(R)
        t > 1:  G' = QLᵀ G QR                                          (the gradient in the eigenbasis)
                m = beta1 m + (1 - beta1) G',  v = beta2 v + (1 - beta2) G'²        (Adam, n = t - 1 updates)
                W = W (1 - lr weight_decay) - lr QL (m / (1 - beta1^n)) / (sqrt(v / (1 - beta2^n)) + eps) QRᵀ
                L = beta2 L + (1 - beta2) G Gᵀ,  R = beta2 R + (1 - beta2) Gᵀ G
                every ``precondition_frequency`` steps: QL', QR' = eigh(L), eigh(R), m = QL'ᵀ QL m QRᵀ QR', Q = Q'

    As the paper's reference code, the first step only builds the preconditioners (an eigenbasis of ``G Gᵀ`` alone
    has a null space that ``G`` does not reach, where Adam would normalise rounding noise into a full-size step),
    the basis used at a step is the one from before that step's gradient, and ``v`` is not rotated. The bases come
    from ``torch.linalg.eigh``, with a canonical basis of a (near) null space (``eigenbasis``); the paper's
    alternative, a QR power iteration, is not used.

    Where a parameter is a DTensor that splits its matrices (FSDP2, tensor, expert parallelism, their hybrids) the
    gradient is gathered whole (``matrices.whole``) and every rank of the shard group holds and updates the same
    whole ``L``, ``R``, ``QL``, ``QR``, ``m`` and ``v`` and keeps its own shard of the update: one gather per matrix
    and no scatter, at the price of the state's memory and the eigendecompositions repeated on each rank of the
    shard group. ZeRO-1 steps each matrix on one owner rank, which alone holds its state. ``shard_local = True``
    preconditions each local shard instead (``MatrixOptimizer``).

    A group with ``head_axis``/``head_width`` (``optim.per_head``) preconditions each attention head's block of its
    projections as its own matrix (a stack: ``L``, ``R`` and the moments per head). It is gathered whole even where
    a shard holds whole heads, so its state keeps the whole projection's shapes under every layout.

    The preconditioners and rotated moments are kept in ``precondition_dtype`` (float64 for the parity tests; a
    checkpoint's load casts them to the parameter's dtype, as torch's ``Optimizer.load_state_dict`` does any state,
    and the next step casts them back).

    State: ``step``, ``L``, ``R``, ``QL``, ``QR``, ``exp_avg``, ``exp_avg_sq`` per matrix, plain tensors of the
    whole matrix's shapes (the same under every layout), so ``torch.distributed.checkpoint`` saves them once and
    loads them whole on every rank; ``step``/``exp_avg``/``exp_avg_sq`` per AdamW parameter, laid out like it.
    """

    # written here: heavyball 3.2's SOAP is an optimiser of its own (it gathers each DTensor's parameter, update and
    # gradient itself) and preconditions an expert stack [E, rows, cols] as one tensor, [E, rows*cols] or 3 factors

    matrix_key = "soap"

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.95, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        precondition_frequency: int = 10,
        precondition_dtype: str = "float32",
        null_space_rtol: float = 1e-3,
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        precondition_frequency=precondition_frequency, precondition_dtype=precondition_dtype,
                        null_space_rtol=null_space_rtol)
        super().__init__(params, defaults)

    def matrix_step(self, group: dict[str, Any], p: Tensor, g: Tensor) -> None:
        """SOAP's step of one matrix (or stack of matrices) ``p`` with local gradient ``g``."""
        gathered = not self.shard_local
        grad = self.gather_whole(g, p) if gathered else g
        heads = self.head_blocks(group)
        if heads:  # each head's block is a matrix of its own: a stack of them
            grad = to_heads(grad, heads)
        grad = grad.to(PRECONDITION_DTYPES[group["precondition_dtype"]])
        state = self.state[p]
        if not state:
            rows, cols = grad.shape[-2:]
            batch = grad.shape[:-2]
            state["step"] = torch.tensor(0.0)
            for key, size in (("L", rows), ("R", cols)):
                state[key] = torch.zeros(*batch, size, size, dtype=grad.dtype)
                state[f"Q{key}"] = torch.zeros(*batch, size, size, dtype=grad.dtype)
            state["exp_avg"] = torch.zeros_like(grad)
            state["exp_avg_sq"] = torch.zeros_like(grad)
        else:  # torch's load_state_dict casts a loaded state to the parameter's dtype: back to the preconditioners'
            for key in ("L", "R", "QL", "QR", "exp_avg", "exp_avg_sq"):
                if state[key].dtype != grad.dtype:
                    state[key] = state[key].to(grad.dtype)
        state["step"] += 1
        step = int(state["step"].item())
        beta1, beta2 = group["betas"]
        left, right, exp_avg = state["QL"], state["QR"], state["exp_avg"]
        if step > 1:
            rotated = left.mT @ grad @ right
            exp_avg.lerp_(rotated, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(rotated, rotated, value=1 - beta2)
            n = step - 1
            normalised = (exp_avg / (1 - beta1 ** n)) / (
                (state["exp_avg_sq"] / (1 - beta2 ** n)).sqrt() + group["eps"])
            update = left @ normalised @ right.mT
            if heads:
                update = from_heads(update, heads)
            if gathered:
                update = shard_of(update, p)
            lr = group["lr"]
            w = local(p)
            w.mul_(1 - lr * group["weight_decay"])
            w.add_(update.to(w.dtype), alpha=-lr)
        state["L"].lerp_(grad @ grad.mT, 1 - beta2)
        state["R"].lerp_(grad.mT @ grad, 1 - beta2)
        if step == 1 or (step - 1) % group["precondition_frequency"] == 0:
            rtol = group["null_space_rtol"]
            new_left, new_right = eigenbasis(state["L"], rtol), eigenbasis(state["R"], rtol)
            if step > 1:  # the first moment into the new basis (the paper's rotation)
                exp_avg.copy_(new_left.mT @ (left @ exp_avg @ right.mT) @ new_right)
            left.copy_(new_left)
            right.copy_(new_right)


PRECONDITION_DTYPES = {"float32": torch.float32, "float64": torch.float64}


def eigenbasis(preconditioner: Tensor, null_space_rtol: float) -> Tensor:
    """Eigenvectors (columns, ascending eigenvalues) of a symmetric positive semi-definite matrix, or of each of a
    stack, with a canonical basis of its (near) null space: the eigenvalues at most ``null_space_rtol`` times the
    largest.

    A preconditioner of a matrix with more rows than columns (and any one after few steps) is rank-deficient, and
    ``torch.linalg.eigh`` returns an arbitrary basis of its null space that jumps with rounding; the eigenvectors of
    its smallest, closely spaced eigenvalues move as much with the rounding of the gradients (which differs between
    layouts) as with the data. Adam's per-value normalisation is not rotation-invariant and gives those directions
    full-size steps, so their basis is made by Gram-Schmidt (QR) of the first unit vectors projected onto their
    span, which moves continuously with the matrix.
    """
    if preconditioner.ndim == 3:
        if len(preconditioner) == 0:
            return preconditioner.clone()
        return torch.stack([eigenbasis(m, null_space_rtol) for m in preconditioner])
    size = preconditioner.shape[-1]
    values, vectors = torch.linalg.eigh(preconditioner)
    if size == 0:  # an empty shard (the per-shard mistake of the tests)
        return vectors
    if not values[-1] > 0:  # nothing seen yet (a state made by a step on zero gradients)
        return torch.eye(size, dtype=vectors.dtype, device=vectors.device)
    null = int((values <= values[-1] * null_space_rtol).sum())
    if null == 0:
        return vectors
    span = vectors[:, null:]
    projector = torch.eye(size, dtype=vectors.dtype, device=vectors.device) - span @ span.T
    return torch.cat([torch.linalg.qr(projector[:, :null]).Q, span], dim=1)


@dataclass
class SoapConfig:
    """SOAP (Shampoo's eigenbasis with Adam inside it) for the hidden matrices, AdamW for the rest, each matrix whole
    under every layout."""

    name: str = "soap"
    """Registry name."""
    lr: float = 3e-3
    """Peak learning rate of the matrices."""
    betas: list[float] = field(default_factory=lambda: [0.95, 0.95])
    """[beta1, beta2]: the rotated Adam's moments; beta2 also averages the preconditioners L and R."""
    eps: float = 1e-8
    """The rotated Adam's epsilon."""
    weight_decay: float = 0.01
    """Decoupled weight decay of the matrices."""
    precondition_frequency: int = 10
    """Steps between eigendecompositions of the preconditioners (the first step always computes them), >= 1."""
    precondition_dtype: str = "float32"
    """The dtype of L, R, their bases and the rotated moments: float32 or float64 (the parity tests: float32's
    eigenvectors amplify rounding)."""
    null_space_rtol: float = 1e-3
    """Eigenvalues at most this fraction of a preconditioner's largest share a canonical basis rather than their
    eigenvectors (see ``eigenbasis``), in [0, 1). 1e-3 rather than the paper's plain eigh (0): on the GPT parity
    runs DDP's final weights were off one process's by 4e-2 at 0, 3.8e-4 at 1e-5, 4.7e-6 at 1e-3 and 4.2e-5 at 1e-2
    (1e-1 did as well as 1e-3 by giving most of a small matrix's spectrum the canonical basis)."""
    matrix_params: list[str] = field(default_factory=list)
    """fnmatch patterns of parameter names (2-D or 3-D) sent to SOAP whatever the rule says."""
    per_head: bool = False
    """Precondition each attention head's block of the q/k/v and output projections as its own matrix (the model
    declares where its heads lie: ``attention_heads()``), rather than each projection whole."""
    other: MuonOthers = field(default_factory=MuonOthers)
    """AdamW's options and patterns for the parameters SOAP does not step."""

    def validate(self) -> None:
        """Reject values outside the ranges the update rule is defined for."""
        checks.positive("optim.lr", self.lr)
        checks.betas("optim.betas", self.betas)
        checks.positive("optim.eps", self.eps)
        checks.non_negative("optim.weight_decay", self.weight_decay)
        if self.precondition_frequency < 1:
            raise ConfigError("optim.precondition_frequency", self.precondition_frequency, "an integer >= 1")
        checks.one_of("optim.precondition_dtype", self.precondition_dtype, tuple(PRECONDITION_DTYPES))
        if not 0 <= self.null_space_rtol < 1:
            raise ConfigError("optim.null_space_rtol", self.null_space_rtol, "a number in [0, 1)")
        checks.positive("optim.other.lr", self.other.lr)
        checks.betas("optim.other.betas", self.other.betas)
        checks.positive("optim.other.eps", self.other.eps)
        checks.non_negative("optim.other.weight_decay", self.other.weight_decay)


@OPTIMIZERS.register("soap", SoapConfig)
def build_soap(cfg: SoapConfig, model: nn.Module) -> Soap:
    """SOAP over the (possibly wrapped) model's matrices (Muon's routing) and AdamW over its other trainable
    parameters; rank 0 prints the routing (on a pipeline, of its own stages)."""
    matrices, others = route(model, list(cfg.matrix_params), list(cfg.other.params))
    matrix_param_groups, heads = matrix_groups(model, matrices, cfg.per_head)
    if not dist.is_initialized() or dist.get_rank() == 0:
        for line in routing_lines(matrices, others, "soap", heads):
            print(line, flush=True)
    adam_options = {"soap": False, "lr": cfg.other.lr, "betas": tuple(cfg.other.betas), "eps": cfg.other.eps}
    groups = [*matrix_param_groups,
              {"params": [p for _, p in others if p.ndim >= 2], "weight_decay": cfg.other.weight_decay, **adam_options},
              {"params": [p for _, p in others if p.ndim < 2], "weight_decay": 0.0, **adam_options}]
    return Soap([g for g in groups if g["params"]], lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps,
                weight_decay=cfg.weight_decay, precondition_frequency=cfg.precondition_frequency,
                precondition_dtype=cfg.precondition_dtype, null_space_rtol=cfg.null_space_rtol)
