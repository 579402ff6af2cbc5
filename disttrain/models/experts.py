"""A mixture-of-experts feed-forward layer: a router picks ``top_k`` of ``n_experts`` SwiGLU experts per token.

Routing. The router's softmax scores ``s`` (fp32) pick each token's ``top_k`` experts by ``s + b``, where ``b`` is
the per-expert bias of auxiliary-loss-free balancing (DeepSeek-V3, Wang et al. 2024: after every optimiser step
each expert's bias moves by ``bias_update_rate`` towards the mean load, up when the expert took fewer tokens than
the mean, down when more; ``disttrain.rank.experts``). The bias only selects: the chosen experts' outputs are
weighted by their unbiased scores, renormalised to sum to one over the ``top_k``.

Balance loss. ``aux_loss_coef * sum_i f_i P_i`` per sequence, averaged over sequences (DeepSeek-V3's sequence-wise
form of the Switch Transformer loss), where ``f_i`` is expert i's share of the sequence's ``T x top_k``
assignments times ``n_experts`` and ``P_i`` its mean score over the sequence. Sequence-wise, it is the same
number whatever the split of a batch over ranks, micro-batches or pipeline microbatches, so a distributed run's
gradient equals one process's. It enters training through the gradient of the layer's output
(``AuxiliaryLossGradient``), so the model's forward still returns only logits and pipeline stages carry it too.

Capacity. ``capacity_factor`` None drops nothing. A factor c lets each expert take at most
``ceil(c * T * top_k / n_experts)`` tokens of each sequence, the earliest positions first; a dropped assignment
contributes nothing (the residual stream carries the token on). Per sequence, so the dropped tokens are the same
under any data-parallel split.

Experts. The tokens' assignments are sorted by expert and each expert's rows multiply its weights in one grouped
matrix product (``torch._grouped_mm`` where its alignment holds, else one product per expert). Under expert
parallelism the module's ``expert_parallel`` (set by ``disttrain.parallel.experts``) sends each expert's rows to
the rank that holds it and brings the results back in their order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from disttrain.models.attention import SequenceSplit


class ExpertExchange(Protocol):
    """What experts ask of expert parallelism (``disttrain.parallel.experts`` builds it)."""

    def local_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's experts' rows of an ``[n_experts, ...]`` weight, as a plain tensor."""
        ...

    def exchange(self, rows: torch.Tensor, counts: torch.Tensor,
                 compute: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``rows`` sorted by expert (``counts[e]`` rows for expert ``e``) sent to their experts' ranks, computed
        there by ``compute(rows, counts_per_local_expert)`` and returned in the same order."""
        ...


class AuxiliaryLossGradient(torch.autograd.Function):
    """Returns ``output`` unchanged; in backward, ``loss`` receives the gradient ``scale`` (a balance loss enters
    the objective without being added to the model's output)."""

    @staticmethod
    def forward(ctx, output: torch.Tensor, loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.loss_shape, ctx.loss_dtype = loss.shape, loss.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        grad_loss = torch.full(ctx.loss_shape, ctx.scale, dtype=ctx.loss_dtype, device=grad_output.device)
        return grad_output, grad_loss, None


def grouped_matmul(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``rows`` ``[M, in]`` sorted by expert (``counts[e]`` rows each) times their expert's ``weight[e]``
    ``[in, out]``: ``[M, out]``."""
    weight = weight.to(rows.dtype)
    if _grouped_mm_aligned(rows, weight):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._grouped_mm(rows.contiguous(), weight, offs=offsets)
    # torch's grouped kernel needs 16-byte-aligned rows; other widths take one product per expert
    parts = rows.split(counts.tolist())
    return torch.cat([part @ weight[e] for e, part in enumerate(parts)])


def _grouped_mm_aligned(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm`` takes these operands: widths whose rows are 16-byte multiples, and under
    torch.compile bf16 ones (its meta kernel, which tracing runs, takes no other type)."""
    size = rows.element_size()
    traceable = rows.dtype == torch.bfloat16 or not torch.compiler.is_compiling()
    return hasattr(torch, "_grouped_mm") and traceable and (rows.size(-1) * size) % 16 == 0 \
        and (weight.size(-1) * size) % 16 == 0


class _ContiguousGradient(torch.autograd.Function):
    """Identity whose gradient is made contiguous (the grouped kernel's backward refuses expanded gradients)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


class GroupedExperts(nn.Module):
    """``n_experts`` SwiGLU networks as three ``[n_experts, ...]`` weights: expert e maps a row x to
    ``(silu(x w1[e]) * x w3[e]) w2[e]``."""

    expert_parallel: ExpertExchange | None = None
    """Set by expert parallelism: this rank holds some of the experts and exchanges rows with the others."""

    def __init__(self, n_experts: int, n_embd: int, hidden: int) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.w1 = nn.Parameter(torch.empty(n_experts, n_embd, hidden))
        self.w3 = nn.Parameter(torch.empty(n_experts, n_embd, hidden))
        self.w2 = nn.Parameter(torch.empty(n_experts, hidden, n_embd))

    def forward(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows ``[M, C]`` sorted by expert, ``counts[e]`` of them for expert ``e``: their experts' outputs."""
        if self.expert_parallel is None:
            return self._swiglu(rows, counts, self.w1, self.w3, self.w2)
        exchange = self.expert_parallel
        w1, w3, w2 = (exchange.local_weight(w) for w in (self.w1, self.w3, self.w2))
        return exchange.exchange(rows, counts, lambda local, local_counts: self._swiglu(local, local_counts,
                                                                                        w1, w3, w2))

    @staticmethod
    def _swiglu(rows: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor
                ) -> torch.Tensor:
        rows = _ContiguousGradient.apply(rows)
        hidden = F.silu(grouped_matmul(rows, w1, counts)) * grouped_matmul(rows, w3, counts)
        return grouped_matmul(_ContiguousGradient.apply(hidden), w2, counts)


class Routing:
    """One forward's routing of ``[B, T]`` tokens: chosen experts, weights, kept assignments and statistics."""

    def __init__(self, experts: torch.Tensor, weights: torch.Tensor, kept: torch.Tensor | None,
                 load: torch.Tensor) -> None:
        self.experts = experts
        """``[B, T, k]`` chosen expert of each assignment."""
        self.weights = weights
        """``[B, T, k]`` its weight in the token's output."""
        self.kept = kept
        """``[B, T, k]`` whether the expert had room for it (None: every assignment is kept)."""
        self.load = load
        """``[n_experts]`` assignments per expert before any drop."""


class MoEFeedForward(nn.Module):
    """Router, grouped experts and an optional shared expert: ``[B, T, C] -> [B, T, C]`` (see the module
    docstring for routing, balance and capacity)."""

    sequence_split: SequenceSplit | None = None
    """Set by context parallelism: the balance loss counts each sequence's assignments over all its ranks."""

    def __init__(self, n_embd: int, n_experts: int, top_k: int, hidden: int, shared: nn.Module | None = None,
                 aux_loss_coef: float = 0.0, bias_update_rate: float = 0.0, capacity_factor: float | None = None,
                 dropout: float = 0.0) -> None:
        super().__init__()
        self.n_experts, self.top_k = n_experts, top_k
        self.aux_loss_coef, self.bias_update_rate, self.capacity_factor = aux_loss_coef, bias_update_rate, \
            capacity_factor
        self.router = nn.Linear(n_embd, n_experts, bias=False)
        self.experts = GroupedExperts(n_experts, n_embd, hidden)
        self.shared = shared
        self.drop = nn.Dropout(dropout)
        self.register_buffer("expert_bias", torch.zeros(n_experts), persistent=True)
        self.aux_loss_scale = 1.0
        """The gradient the balance loss enters backward with: 1 / forward passes per optimiser step, as each
        micro-batch's cross-entropy (set by ``disttrain.rank.experts``)."""
        self.step_load: torch.Tensor | None = None
        """Assignments per expert summed over this optimiser step's training forwards (before drops)."""
        self.step_dropped: torch.Tensor | None = None
        """Assignments dropped for lack of capacity over this step's training forwards."""
        self.step_aux_loss: torch.Tensor | None = None
        """Sum of the balance losses of this step's training forwards, and their count (``[2]``)."""

    def route(self, x: torch.Tensor) -> tuple[Routing, torch.Tensor]:
        """Each token's experts and weights, and the router's scores ``[B, T, E]`` (fp32)."""
        scores = F.softmax(self.router(x).float(), dim=-1)
        choice = scores + self.expert_bias if self.bias_update_rate else scores
        experts = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        weights = weights / weights.sum(-1, keepdim=True)
        chosen = F.one_hot(experts, self.n_experts).sum(2)  # [B, T, E] 0/1 per token and expert
        kept = self._within_capacity(experts, chosen) if self.capacity_factor is not None else None
        return Routing(experts, weights, kept, chosen.sum((0, 1))), scores

    def _within_capacity(self, experts: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """``[B, T, k]``: whether each assignment is among the first ``capacity`` of its expert in its sequence."""
        length = chosen.size(1)
        capacity = math.ceil(self.capacity_factor * length * self.top_k / self.n_experts)
        earlier = chosen.cumsum(1) - chosen  # assignments to each expert at earlier positions of the sequence
        return earlier.gather(-1, experts) < capacity

    def balance_loss(self, chosen_per_sequence: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The sequence-wise balance loss (module docstring) from ``[B, E]`` assignment counts of whole sequences
        and this rank's ``[B, T, E]`` scores."""
        length = scores.size(1) * (self.sequence_split.size if self.sequence_split is not None else 1)
        share = chosen_per_sequence.float() * (self.n_experts / (length * self.top_k))
        return self.aux_loss_coef * (share * scores.mean(1)).sum(-1).mean()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, C] -> [B, T, C]``."""
        b, t, c = x.shape
        routing, scores = self.route(x)
        flat_experts = routing.experts.reshape(-1)
        token_of = torch.arange(b * t, device=x.device).repeat_interleave(self.top_k)
        weight_of = routing.weights.reshape(-1)
        if routing.kept is not None:
            kept = routing.kept.reshape(-1)
            flat_experts, token_of, weight_of = flat_experts[kept], token_of[kept], weight_of[kept]
        order = torch.argsort(flat_experts, stable=True)
        counts = torch.bincount(flat_experts, minlength=self.n_experts)
        token_of = token_of[order]
        rows = self.experts(x.reshape(b * t, c)[token_of], counts)
        weighted = rows * weight_of[order].unsqueeze(-1).to(rows.dtype)
        out = torch.zeros(b * t, c, dtype=weighted.dtype, device=x.device).index_add_(0, token_of, weighted)
        out = out.view(b, t, c).to(x.dtype)
        if self.shared is not None:
            out = out + self.shared(x)
        out = self.drop(out)
        if self.training:
            # activation checkpointing runs this forward again in backward: its tokens are counted already
            recomputing = _in_backward()
            if not recomputing:
                self._record(routing, flat_experts.numel())
            if self.aux_loss_coef:
                per_sequence = F.one_hot(routing.experts, self.n_experts).sum((1, 2))
                if self.sequence_split is not None:
                    per_sequence = self.sequence_split.total(per_sequence)
                loss = self.balance_loss(per_sequence, scores)
                if not recomputing:
                    self._record_aux(loss.detach())
                out = AuxiliaryLossGradient.apply(out, loss, self.aux_loss_scale)
        return out

    def _record(self, routing: Routing, kept_assignments: int) -> None:
        load = routing.load.detach()
        dropped = load.sum() - kept_assignments
        self.step_load = load if self.step_load is None else self.step_load + load
        self.step_dropped = dropped if self.step_dropped is None else self.step_dropped + dropped

    def _record_aux(self, loss: torch.Tensor) -> None:
        entry = torch.stack([loss.float(), torch.ones((), device=loss.device)])
        self.step_aux_loss = entry if self.step_aux_loss is None else self.step_aux_loss + entry

    def take_step_statistics(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """This step's load, drops and balance-loss sum (None where nothing was recorded), and start afresh."""
        taken = (self.step_load, self.step_dropped, self.step_aux_loss)
        self.step_load = self.step_dropped = self.step_aux_loss = None
        return taken

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """Auxiliary-loss-free balancing: move each expert's bias by ``bias_update_rate`` towards the mean of
        ``load`` (the step's assignments per expert over all ranks)."""
        if self.bias_update_rate:
            load = load.float()
            self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load).to(self.expert_bias.device)


def _in_backward() -> bool:
    """Whether autograd is running a backward pass now (where a checkpointed block's forward is recomputed); the
    test torch's own FSDP2 uses to tell a recomputation from a forward."""
    return torch._C._current_graph_task_id() != -1


def moe_layers(model: nn.Module) -> list[tuple[str, MoEFeedForward]]:
    """The mixture-of-experts layers of ``model`` with their names."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoEFeedForward)]
