"""The router balance loss a Hugging Face mixture of experts defines, in disttrain's training loss.

With ``output_router_logits`` a ``transformers`` mixture (Mixtral, Qwen2-MoE, Qwen3-MoE, ...) computes
``router_aux_loss_coef * load_balancing_loss_func(router_logits, num_experts, num_experts_per_tok)``, but adds it
only to the loss it computes from ``labels``; disttrain computes its cross-entropy from the logits. Here the same
term, computed by the model module's own ``load_balancing_loss_func``, enters training as model=moe's balance loss
does: through the gradient of the logits (``AuxiliaryLossGradient``), weighted as one forward pass of the step
(``aux_loss_scale``), so the forward still returns only logits.

The loss is batch-wide: per expert, the share of the forward's assignments times its mean router probability, over
all the tokens of the forward, which is not a mean of the ranks' parts. Under data or context parallelism every
rank gathers the router logits of the ranks whose micro-batches make up the step's batch (``balance_group``) and
computes the loss of that whole batch, as one process computing it does; the gather's backward returns each rank
the gradient of its own rows summed over the ranks, so the averaged gradient is one process's.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed.nn.functional as distributed_autograd
from torch import nn

from disttrain.models.experts import AuxiliaryLossGradient

LOSS_FUNCTION = "load_balancing_loss_func"
"""The name of the balance loss in a ``transformers`` mixture's modeling module."""


def balance_loss_refusal(config: Any, model_class: type) -> str | None:
    """Why ``output_router_logits`` cannot train ``model_class`` on its balance loss (None: it can)."""
    if getattr(sys.modules[model_class.__module__], LOSS_FUNCTION, None) is None or \
            not hasattr(config, "router_aux_loss_coef"):
        return f"false (+model.output_router_logits=false): {model_class.__name__} defines no router balance loss"
    return None


def take_balance_loss(net: nn.Module, model: nn.Module) -> None:
    """Give ``net`` (wrapping the ``transformers`` ``model``) the protocol's ``balance_group`` and
    ``aux_loss_scale`` when the model's config asks for its router's balance loss."""
    if getattr(model.config, "output_router_logits", False):
        net.balance_group = None
        net.aux_loss_scale = 1.0


def logits_with_balance_loss(net: nn.Module, output: Any) -> torch.Tensor:
    """The logits of ``output`` (the model's ``ModelOutput``), carrying in training the gradient of the router's
    balance loss over the step's batch (module docstring)."""
    router_logits = getattr(output, "router_logits", None)
    if not net.training or not router_logits or not hasattr(net, "balance_group"):
        return output.logits
    model = net._model
    if net.balance_group is not None:
        stacked = torch.stack(router_logits)  # [layers, tokens, experts]: one gather for every layer
        gathered = distributed_autograd.all_gather(stacked, group=net.balance_group)
        router_logits = tuple(torch.cat(gathered, dim=1).unbind(0))
    loss_function = getattr(sys.modules[type(model).__module__], LOSS_FUNCTION)
    loss = model.router_aux_loss_coef * loss_function(router_logits, model.num_experts, model.num_experts_per_tok)
    return AuxiliaryLossGradient.apply(output.logits, loss, net.aux_loss_scale)
