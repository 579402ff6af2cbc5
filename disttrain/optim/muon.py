"""Muon (Jordan et al., 2024; torch.optim.Muon's update) for the hidden matrices, AdamW for every other parameter,
each matrix orthogonalised whole under every layout."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS, _adjust_lr
from torch.optim._muon import _zeropower_via_newtonschulz as _torch_newton_schulz

from disttrain import checks
from disttrain.errors import ConfigError
from disttrain.models.heads import HeadBlocks, from_heads, head_blocks_of, to_heads
from disttrain.optim.matrices import holds_whole_heads, holds_whole_matrices, shard_of
from disttrain.optim.matrix_optimizer import MatrixOptimizer
from disttrain.optim.norms import local
from disttrain.optim.registry import OPTIMIZERS

NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
ADJUST_LR_FNS = ("original", "match_rms_adamw")
HEAD_MODULES = ("lm_head", "output", "classifier", "score")
"""Names of the module that holds a model's output head (its last name part); a module named ``head`` anywhere in a
parameter's path marks a head too (a CNN's ``head.fc``). Their matrices go to AdamW, as Muon's authors advise."""


class Muon(MatrixOptimizer):
    """torch.optim.Muon's update for the groups with ``muon=True``, torch's AdamW for the others, in one optimiser
    (so ZeRO-1, the schedule and checkpoints see one optimiser).

    Per matrix ``W`` with gradient ``G`` (a 3-D parameter ``[E, rows, cols]`` is ``E`` matrices, an MoE expert
    stack)::

        B = momentum B + (1 - momentum) G              (torch's lerp form)
        U = G + momentum (B - G) if nesterov else B
        O = NewtonSchulz(U)                            (ns_steps quintic steps with ns_coefficients, in ns_dtype)
        W = W (1 - lr weight_decay) - adjust_lr(lr, shape) O

    The iteration needs the whole matrix: where a parameter is a DTensor that splits its matrices (FSDP2, tensor
    parallelism, both) the momentum-updated ``U`` is gathered, every rank of the shard group orthogonalises it and
    keeps its own shard of ``O``. Every rank computes it rather than one owner per matrix that sends the result back:
    that needs one gather and no scatter (an owner would add a scatter of ``O`` per matrix), at the price of the
    iteration's FLOPs repeated on each rank of the shard group, which owners chosen to balance the matrices would
    save. ZeRO-1 already steps each matrix on one owner rank. Expert stacks split only by expert are stepped where
    they lie. ``shard_local = True`` orthogonalises each local shard instead (``MatrixOptimizer``).

    A group with ``head_axis``/``head_width`` (``optim.per_head``) orthogonalises each attention head's block of
    its projections as its own matrix, at that block's adjusted rate; where this rank's shard holds whole heads
    (tensor parallelism, FSDP2's row shards of q/k/v that split between heads) they are stepped where they lie,
    otherwise the projection is gathered whole as any matrix.

    State: ``momentum_buffer`` per matrix, ``step``/``exp_avg``/``exp_avg_sq`` per AdamW parameter, laid out like the
    parameter, so ``torch.distributed.checkpoint.state_dict`` saves and reshards it as AdamW's.
    """

    matrix_key = "muon"
    adamw_eps_key = "adam_eps"

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
        eps: float = EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str = "original",
        ns_dtype: str = "bfloat16",
        betas: tuple[float, float] = (0.9, 0.95),
        adam_eps: float = 1e-8,
    ) -> None:
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                        ns_coefficients=tuple(ns_coefficients), eps=eps, ns_steps=ns_steps,
                        adjust_lr_fn=adjust_lr_fn, ns_dtype=ns_dtype, betas=tuple(betas), adam_eps=adam_eps)
        super().__init__(params, defaults)

    def matrix_step(self, group: dict[str, Any], p: Tensor, g: Tensor) -> None:
        """Muon's step of one matrix (or stack of matrices) ``p`` with local gradient ``g``."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        buf = local(state["momentum_buffer"])
        momentum = group["momentum"]
        buf.lerp_(g, 1 - momentum)
        update = g.lerp(buf, momentum) if group["nesterov"] else buf
        heads = self.head_blocks(group)
        whole_here = holds_whole_heads(p, heads) if heads else holds_whole_matrices(p)
        gathered = not (self.shard_local or whole_here)
        matrices = self.gather_whole(update, p) if gathered else update
        if heads:  # each head's block is a matrix of its own: a stack of them
            matrices = to_heads(matrices, heads)
        ortho = orthogonalise(matrices, group["ns_coefficients"], group["ns_steps"], group["eps"],
                              NS_DTYPES[group["ns_dtype"]])
        if heads:
            ortho = from_heads(ortho, heads)
        if gathered:
            ortho = shard_of(ortho, p)
        lr = group["lr"]
        # the whole matrix's shape (an expert stack's matrices are [rows, cols] after the expert index), or a head's
        adjusted_lr = _adjust_lr(lr, group["adjust_lr_fn"], heads.block_shape(p.shape) if heads else p.shape[-2:])
        w = local(p)
        w.mul_(1 - lr * group["weight_decay"])
        w.add_(ortho.to(w.dtype), alpha=-adjusted_lr)


def orthogonalise(matrices: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> Tensor:
    """Newton-Schulz orthogonalisation of a matrix, or of each matrix of a 3-D stack, computed in ``dtype``: torch's
    own function where that is bfloat16, its iteration in ``dtype`` otherwise."""
    if matrices.ndim == 3:
        if matrices.shape[0] == 0:
            return matrices.clone()
        return torch.stack([orthogonalise(m, coefficients, steps, eps, dtype) for m in matrices])
    if dtype == torch.bfloat16:
        return _torch_newton_schulz(matrices, coefficients, steps, eps)
    return newton_schulz(matrices, coefficients, steps, eps, dtype)


def newton_schulz(matrix: Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> Tensor:
    """torch's ``_zeropower_via_newtonschulz`` in ``dtype`` (the parity tests' float32)."""
    # torch's function casts to bfloat16 unconditionally; the same steps, in the dtype asked for
    a, b, c = coefficients
    x = matrix.to(dtype)
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def is_matrix_by_rule(aliases: list[tuple[str, nn.Module]], param: Tensor) -> bool:
    """The default routing: a 2-D weight, or a 3-D stack of matrices (MoE experts), none of whose names belongs to an
    embedding, a convolution or the output head (``aliases``: each name of the parameter and the module holding it
    under that name; a head tied to the embedding has two)."""
    if param.ndim not in (2, 3):
        return False
    for name, module in aliases:
        parts = name.split(".")[:-1]
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag, nn.modules.conv._ConvNd)) or "head" in parts \
                or (parts and parts[-1] in HEAD_MODULES):
            return False
    return True


def route(model: nn.Module, matrix_patterns: list[str], other_patterns: list[str]) -> tuple[
        list[tuple[str, Tensor]], list[tuple[str, Tensor]]]:
    """``(matrices, others)``: the trainable parameters of ``model`` (by name) that Muon steps and those AdamW steps.

    A parameter any of whose names matches one of ``other_patterns`` (fnmatch) goes to AdamW, one of
    ``matrix_patterns`` to Muon (it must be 2-D or 3-D), any other by ``is_matrix_by_rule``. A ConfigError names a
    parameter that both match, or a matrix pattern that picks a parameter Muon cannot step. Names are the wrapped
    model's (the same under every layout).
    """
    aliases: dict[int, list[tuple[str, nn.Module]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for param_name, p in module.named_parameters(recurse=False):
            aliases.setdefault(id(p), []).append((f"{module_name}.{param_name}".lstrip("."), module))
    matrices, others = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        names = [alias for alias, _ in aliases[id(p)]]
        as_other = any(fnmatch.fnmatchcase(n, pat) for n in names for pat in other_patterns)
        as_matrix = any(fnmatch.fnmatchcase(n, pat) for n in names for pat in matrix_patterns)
        if as_other and as_matrix:
            raise ConfigError("optim.matrix_params", name, "a parameter that optim.other.params does not name too")
        if as_matrix and p.ndim not in (2, 3):
            raise ConfigError("optim.matrix_params", f"{name} ({p.ndim}-D)", "patterns of 2-D or 3-D parameters")
        matrix = as_matrix or (not as_other and is_matrix_by_rule(aliases[id(p)], p))
        (matrices if matrix else others).append((name, p))
    if not matrices and not others:
        raise ValueError(f"{type(model).__name__} has no trainable parameters")
    return matrices, others


def routing_lines(matrices: list[tuple[str, Tensor]], others: list[tuple[str, Tensor]],
                  matrix_optimiser: str = "muon", heads: dict[str, HeadBlocks] | None = None) -> list[str]:
    """One line per optimiser (``matrix_optimiser`` names the matrices' one): how many parameters (tensors and
    values) it steps and their share of the values; ``heads`` (given where ``optim.per_head`` is on: the matrices'
    attention heads) adds how many projections it steps per head, as how many head matrices."""
    total = sum(p.numel() for _, p in matrices + others) or 1
    lines = [f"disttrain: {label}: {len(items)} tensors, {sum(p.numel() for _, p in items):,} values "
             f"({100 * sum(p.numel() for _, p in items) / total:.1f}% of the parameters)"
             for label, items in ((f"{matrix_optimiser} (hidden matrices)", matrices),
                                  ("adamw (embeddings, head, norms, biases)", others))]
    if heads is not None:
        split = [(p, heads[name]) for name, p in matrices if name in heads]
        lines[0] += (f"; per head: {len(split)} attention projections as "
                     f"{sum(blocks.count(p.shape) for p, blocks in split)} head matrices" if split else
                     "; per head: none (the model declares no attention heads: attention_heads())")
    return lines


def matrix_groups(model: nn.Module, matrices: list[tuple[str, Tensor]], per_head: bool
                  ) -> tuple[list[dict[str, Any]], dict[str, HeadBlocks] | None]:
    """The param groups of ``matrices`` (the whole ones first, then one per head layout with its ``head_axis`` and
    ``head_width``) and, where ``per_head``, the heads ``model`` declares (None otherwise)."""
    heads = head_blocks_of(model) if per_head else None
    by_layout: dict[HeadBlocks | None, list[Tensor]] = {None: []}
    for name, p in matrices:
        blocks = heads.get(name) if heads else None
        by_layout.setdefault(blocks if blocks is not None and p.ndim == 2 else None, []).append(p)
    groups = [{"params": params} if blocks is None else
              {"params": params, "head_axis": blocks.axis, "head_width": blocks.width}
              for blocks, params in by_layout.items()]
    return [g for g in groups if g["params"]], heads


@dataclass
class MuonOthers:
    """AdamW's options for the parameters Muon does not step (embeddings, the output head, norms, biases)."""

    lr: float = 3e-3
    """Peak learning rate of these parameters (the schedule scales it as it scales Muon's)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW's [beta1, beta2]."""
    eps: float = 1e-8
    """AdamW's epsilon."""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay (biases and norm weights, ndim < 2, get none)."""
    params: list[str] = field(default_factory=list)
    """fnmatch patterns of parameter names sent to AdamW whatever the rule says (e.g. ``blocks.0.*``)."""


@dataclass
class MuonConfig:
    """Muon (torch.optim.Muon's update) for the hidden matrices, AdamW for the rest, each matrix whole under every
    layout."""

    name: str = "muon"
    """Registry name."""
    lr: float = 0.02
    """Peak learning rate of the matrices (before ``adjust_lr_fn``)."""
    momentum: float = 0.95
    """Momentum of the matrices' buffer, in [0, 1)."""
    nesterov: bool = True
    """Nesterov momentum."""
    weight_decay: float = 0.1
    """Decoupled weight decay of the matrices (torch's default)."""
    ns_coefficients: list[float] = field(default_factory=lambda: [DEFAULT_A, DEFAULT_B, DEFAULT_C])
    """The Newton-Schulz iteration's quintic coefficients [a, b, c]."""
    ns_steps: int = DEFAULT_NS_STEPS
    """Newton-Schulz steps, 1 to 99."""
    eps: float = EPS
    """Floor of the norm the matrix is divided by before the iteration."""
    adjust_lr_fn: str = "original"
    """Per-shape learning rate: original (sqrt(max(1, rows/cols))) or match_rms_adamw (0.2 sqrt(max(rows, cols)))."""
    ns_dtype: str = "bfloat16"
    """The iteration's dtype: bfloat16 (torch's) or float32."""
    matrix_params: list[str] = field(default_factory=list)
    """fnmatch patterns of parameter names (2-D or 3-D) sent to Muon whatever the rule says."""
    per_head: bool = False
    """Orthogonalise each attention head's block of the q/k/v and output projections as its own matrix (the model
    declares where its heads lie: ``attention_heads()``), rather than each projection whole."""
    other: MuonOthers = field(default_factory=MuonOthers)
    """AdamW's options and patterns for the parameters Muon does not step."""

    def validate(self) -> None:
        """Reject values outside the ranges the update rule is defined for."""
        checks.positive("optim.lr", self.lr)
        checks.unit_interval("optim.momentum", self.momentum)
        checks.non_negative("optim.weight_decay", self.weight_decay)
        checks.positive("optim.eps", self.eps)
        if len(self.ns_coefficients) != 3:
            raise ConfigError("optim.ns_coefficients", self.ns_coefficients, "three numbers [a, b, c]")
        if not 1 <= self.ns_steps < 100:
            raise ConfigError("optim.ns_steps", self.ns_steps, "an integer from 1 to 99")
        checks.one_of("optim.adjust_lr_fn", self.adjust_lr_fn, ADJUST_LR_FNS)
        checks.one_of("optim.ns_dtype", self.ns_dtype, tuple(NS_DTYPES))
        checks.positive("optim.other.lr", self.other.lr)
        checks.betas("optim.other.betas", self.other.betas)
        checks.positive("optim.other.eps", self.other.eps)
        checks.non_negative("optim.other.weight_decay", self.other.weight_decay)


@OPTIMIZERS.register("muon", MuonConfig)
def build_muon(cfg: MuonConfig, model: nn.Module) -> Muon:
    """Muon over the (possibly wrapped) model's matrices and AdamW over its other trainable parameters; rank 0 prints
    the routing (on a pipeline, of its own stages)."""
    matrices, others = route(model, list(cfg.matrix_params), list(cfg.other.params))
    matrix_param_groups, heads = matrix_groups(model, matrices, cfg.per_head)
    if not dist.is_initialized() or dist.get_rank() == 0:
        for line in routing_lines(matrices, others, heads=heads):
            print(line, flush=True)
    adam_options = {"muon": False, "lr": cfg.other.lr, "betas": tuple(cfg.other.betas), "adam_eps": cfg.other.eps}
    groups = [*matrix_param_groups,
              {"params": [p for _, p in others if p.ndim >= 2], "weight_decay": cfg.other.weight_decay, **adam_options},
              {"params": [p for _, p in others if p.ndim < 2], "weight_decay": 0.0, **adam_options}]
    return Muon([g for g in groups if g["params"]], lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.momentum,
                nesterov=cfg.nesterov, ns_coefficients=tuple(cfg.ns_coefficients), eps=cfg.eps,
                ns_steps=cfg.ns_steps, adjust_lr_fn=cfg.adjust_lr_fn, ns_dtype=cfg.ns_dtype)
