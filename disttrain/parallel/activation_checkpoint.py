"""Activation checkpointing of a model's shard units (its repeated blocks): store less in forward, recompute
the rest in backward.

Policies (``parallel.activation_checkpoint``):

- ``full``: a block keeps only its input; backward runs the whole block's forward again.
- ``selective``: a block keeps the outputs of its matrix products, attention and collectives and recomputes
  the element-wise work between them (see ``save_matmuls_and_attention``).

``parallel.checkpoint_every_n_blocks`` = k applies the policy to the k-th, 2k-th, ... shard units (counting
from 1) only; the others keep all their activations (k = 1: every block).

Each chosen block gets an instance attribute ``forward`` that runs its class's ``forward`` under non-reentrant
``torch.utils.checkpoint.checkpoint`` (RNG state preserved, so dropout masks are replayed exactly; the
selective policy through its ``context_fn``). No wrapper module is inserted, unlike
``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``, which moves every parameter under
``_checkpoint_wrapped_module.`` (its state-dict hooks hide that from ``state_dict()``, but
``named_parameters()``, param-group names and optimiser state keys still change). Here the blocks stay the same
objects of the same class, a ``ModuleList`` of them stays indexable and every FQN and state-dict key is
unchanged.

Order: apply this before FSDP or DDP. Hooks that FSDP2 registers on a block run around the checkpointed
``forward``, so its parameters are gathered before the recomputation in backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from disttrain.parallel.config import ACTIVATION_CHECKPOINT
from disttrain.parallel.model_plan import shard_units_of


def _ops(namespace: Any, names: tuple[str, ...]) -> frozenset:
    """The operator packets of ``names`` that this torch build has (older builds lack some attention kernels)."""
    return frozenset(getattr(namespace, name) for name in names if hasattr(namespace, name))


MATMUL_OPS = _ops(torch.ops.aten, ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm"))
"""Matrix products as they reach the dispatcher: ``nn.Linear`` and ``matmul`` are composite and arrive as
``addmm`` (with bias) or ``mm`` (without, or 3-D inputs flattened), batched products as ``bmm``/``baddbmm``
(also attention's math fallback), mixture-of-experts' grouped products as ``_grouped_mm``; ``_scaled_mm`` is the
float8 product."""

ATTENTION_OPS = _ops(torch.ops.aten, (
    "_scaled_dot_product_flash_attention_for_cpu",  # CPU, fp32 and bf16, with or without attn_mask (torch 2.13)
    "_scaled_dot_product_flash_attention",  # CUDA flash kernel
    "_scaled_dot_product_efficient_attention",  # CUDA memory-efficient kernel (also with an attn_mask)
    "_scaled_dot_product_cudnn_attention",  # cuDNN kernel
    "_scaled_dot_product_fused_attention_overrideable",  # out-of-tree backends (XPU, ...)
))
"""Fused attention kernels ``F.scaled_dot_product_attention`` dispatches to. On a CPU torch 2.13 takes the flash
kernel for causal attention and for a boolean or float ``attn_mask`` alike; with dropout in training it falls
back to the math path, whose ``bmm`` products are in ``MATMUL_OPS``."""

COLLECTIVE_OPS = _ops(torch.ops._c10d_functional, (
    "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single"))
"""Functional collectives that tensor and sequence parallelism run inside a block (DTensor redistributions)."""

SAVED_OPS = MATMUL_OPS | ATTENTION_OPS | COLLECTIVE_OPS
"""Operators whose outputs the selective policy keeps."""


def save_matmuls_and_attention(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective checkpointing's operator policy: keep what is expensive to recompute, recompute what is cheap.

    Kept (MUST_SAVE): the outputs of matrix products, fused attention and collectives (``SAVED_OPS``). They
    carry nearly all of a block's FLOPs (a product of ``[n, k]`` by ``[k, m]`` does ``2 n k m`` of them for
    ``n m`` output elements; attention is quadratic in the sequence) or, for collectives, time on the network
    that recomputation would spend again. Attention's kernels also return their softmax statistics (log-sum-
    exp), so backward never rebuilds the ``T x T`` scores.

    Recomputed (PREFER_RECOMPUTE): everything else, the element-wise and normalising work between them
    (layer and RMS norms, GELU/SiLU, residual adds, dropout replayed from the saved RNG state, rotary
    embeddings, casts, views): one or a few FLOPs per element, bound by memory bandwidth, while their inputs and
    outputs are as large as a product's. Backward recomputes them from the kept outputs and the block's input.

    Compared with ``full`` this stores the products' outputs (for GPT: q, k, v, the attention output, both
    projections and the 4x-wide MLP hidden) for not running the products again, which are most of a forward;
    compared with no checkpointing it drops every norm's and activation function's output and input copy.
    """
    return CheckpointPolicy.MUST_SAVE if func.overloadpacket in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts() -> tuple[Any, Any]:
    """The forward and recompute contexts of ``save_matmuls_and_attention`` (a ``checkpoint`` ``context_fn``)."""
    return create_selective_checkpoint_contexts(save_matmuls_and_attention)


class CheckpointedForward:
    """A block's ``forward`` that recomputes the block's activations in backward, as ``policy`` says."""

    def __init__(self, module: nn.Module, policy: str = "full") -> None:
        if policy not in ("full", "selective"):
            raise ValueError(f"activation checkpoint policy {policy!r}: full or selective")
        self.module = module
        self.policy = policy

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.policy == "selective":
            return checkpoint(type(self.module).forward, self.module, *args, use_reentrant=False,
                              context_fn=selective_contexts, **kwargs)
        return checkpoint(type(self.module).forward, self.module, *args, use_reentrant=False, **kwargs)


def checkpointed_blocks(units: list[nn.Module], every_n_blocks: int = 1) -> list[nn.Module]:
    """The blocks a policy applies to: the k-th, 2k-th, ... of ``units`` counting from 1 for ``every_n_blocks`` =
    k (torchtitan's count; ``disttrain.plan.layout.policy_of_units`` prices the same ones)."""
    if every_n_blocks < 1:
        raise ValueError(f"every_n_blocks must be at least 1, got {every_n_blocks}")
    return units[every_n_blocks - 1::every_n_blocks]


def apply_activation_checkpointing(model: nn.Module, units: list[nn.Module] | None = None, policy: str = "full",
                                   every_n_blocks: int = 1) -> nn.Module:
    """Checkpoint every ``every_n_blocks``-th of ``units`` (default: the model's shard units) in place with
    ``policy`` (one of ``ACTIVATION_CHECKPOINT``; ``none`` changes nothing); blocks already checkpointed are
    left as they are."""
    if policy not in ACTIVATION_CHECKPOINT:
        raise ValueError(f"activation checkpoint policy {policy!r}: one of {', '.join(ACTIVATION_CHECKPOINT)}")
    if policy == "none":
        return model
    units = shard_units_of(model) if units is None else units
    if not units:
        raise ValueError(f"{type(model).__name__} has no repeated blocks to checkpoint (declare shard_units())")
    for block in checkpointed_blocks(units, every_n_blocks):
        if not is_checkpointed(block):
            block.forward = CheckpointedForward(block, policy)
    return model


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``apply_activation_checkpointing`` made ``module`` recompute its activations."""
    return isinstance(module.__dict__.get("forward"), CheckpointedForward)


def checkpoint_policy(module: nn.Module) -> str:
    """The policy ``module`` runs under: ``none``, ``full`` or ``selective``."""
    forward = module.__dict__.get("forward")
    return forward.policy if isinstance(forward, CheckpointedForward) else "none"
