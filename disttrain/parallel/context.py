"""Context parallelism: every sequence split over the ranks of the ``cp`` mesh dimension, attention over the whole.

Layout. A sequence of ``T`` tokens is cut into ``2 x cp`` chunks of ``c = T / (2 cp)``; rank ``r`` holds chunks
``r`` and ``2 cp - 1 - r``, an early and a late one. Under a causal mask the query rows of chunk ``i`` see
``(i + 1) c`` keys, so the two chunks of every rank see ``(2 cp + 1) c`` keys together: each rank does the same
attention work, where contiguous slices would leave the last rank with most of it (Megatron's and torchtitan's
load balancing). Tokens keep their global positions: learned position embeddings and rotary angles read them
from ``SequenceSplit.positions``.

Attention. Each layer all-gathers the keys and values of the whole sequence over the cp group and attends its
queries to them, each chunk only to the keys up to its own end: without a mask on torch's CPU flash kernel and on
CUDA's flash or memory-efficient kernels (``disttrain.parallel.causal_blocks``), with dropout or packed documents
(or inputs no such kernel takes) one masked call per chunk. All-gather rather than a ring of key/value blocks: the
two move the same bytes per rank (``(cp-1)/cp`` of the sequence's keys and values), gloo runs point-to-point
messages one after another with no overlap to win, and the gathered keys serve the early/late chunk pairing in one
step (torch's ``context_parallel`` rings over CUDA kernels only). Llama 3
trained with the same all-gather form. The gathered keys and values are not kept for backward: the gather and
the attention are recomputed there (one more all-gather per layer), so what a rank keeps for backward shrinks
as ``1 / cp``, with the whole sequence's keys and values alive for one layer at a time. Packed windows
(``disttrain.models.documents``) keep the same split: the token ids are gathered once per forward for the whole
window's document ids, and each chunk's mask is causal and within the documents of its queries and keys.

The loss. Each rank's loss is the mean over its ``T / cp`` tokens; gradients are averaged over the ranks of
``dp x cp`` (DDP's or FSDP's mean), and since every cp rank holds the same number of tokens the average of their
means is the mean over the whole sequence: the same loss and gradient as one rank holding every token. Where the
data ignores some targets, shards hold different numbers of real ones (or none): the task then counts them over all
ranks and scales the gradients to their mean (``disttrain.rank.target_mean``).

A model opts in by giving the modules that attend or read positions a ``sequence_split`` attribute (None while
the sequence is whole); ``apply_context_parallel`` sets it on each of them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from disttrain.models.attention import attends_in_fp32, device_type_of, document_mask, repeat_kv_heads
from disttrain.parallel import causal_blocks

# torch 2.13 renamed the tensor collectives (the old names warn); earlier versions have only the old ones
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherFirstDim(torch.autograd.Function):
    """All-gather along dim 0 whose backward reduce-scatters (sums) the gradient back to each rank's part."""

    # written here because torch.distributed.nn.functional.all_gather's backward on gloo scatters from group
    # ranks as if they were global ranks, which fails on every subgroup that is not ranks 0..n-1
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        out = x.new_empty((size * x.size(0), *x.shape[1:]))
        _ALL_GATHER(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        part = grad.new_empty((grad.size(0) // ctx.size, *grad.shape[1:]))
        _REDUCE_SCATTER(part, grad.contiguous(), group=ctx.group)
        return part, None, None


class SequenceSplit:
    """Which tokens of every sequence this rank holds, and attention over the whole sequence from them."""

    def __init__(self, group: Any, rank: int, size: int) -> None:
        self.group = group
        """The process group of the cp ranks (None: one rank, no communication)."""
        self.rank = rank
        """This rank's index in the cp group."""
        self.size = size
        """Ranks the sequence is split over."""

    def __deepcopy__(self, memo: dict) -> SequenceSplit:
        # a process group cannot be copied; copies of a model (pipeline stages) share the one split
        return self

    def total(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of ``tensor`` (no gradient) over the cp ranks, which hold parts of the same sequences."""
        summed = tensor.detach().clone()
        if self.group is not None:
            dist.all_reduce(summed, group=self.group)
        return summed

    def chunk_indices(self) -> tuple[int, int]:
        """The chunks of ``2 x size`` this rank holds: an early and a late one."""
        return self.rank, 2 * self.size - 1 - self.rank

    def positions(self, local_length: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of this rank's ``local_length`` tokens (``local_length x size`` in the sequence)."""
        if local_length % 2:
            raise ValueError(f"a rank's share of a split sequence has two equal chunks; got {local_length} tokens")
        c = local_length // 2
        return torch.cat([torch.arange(i * c, (i + 1) * c, device=device) for i in self.chunk_indices()])

    def split(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a whole-sequence ``tensor`` (sequence along ``dim``)."""
        length = tensor.size(dim)
        if length % (2 * self.size):
            raise ValueError(f"a sequence of {length} tokens cannot be split into 2 x cp = {2 * self.size} chunks")
        index = self.positions(length // self.size, tensor.device)
        return tensor.index_select(dim, index)

    def chunk_rows(self, local_length: int) -> list[tuple[slice, int]]:
        """For each of this rank's two chunks: its rows among the local tokens and where it starts in the
        sequence."""
        c = local_length // 2
        return [(slice(half * c, (half + 1) * c), chunk * c) for half, chunk in enumerate(self.chunk_indices())]

    def chunk_masks(self, local_length: int, device: torch.device | str | None = None,
                    documents: torch.Tensor | None = None) -> list[tuple[slice, int, torch.Tensor]]:
        """For each of this rank's two chunks: its rows among the local tokens, how many keys of the whole sequence
        it sees (those up to its own end), and its causal mask over them (True: attended): ``[c, end]``, or with
        ``documents`` (the whole sequence's document ids ``[B, T]``) ``[B, 1, c, end]``, within each document."""
        masks = []
        for rows, start in self.chunk_rows(local_length):
            end = start + rows.stop - rows.start
            positions = torch.arange(start, end, device=device)
            if documents is None:
                mask = torch.arange(end, device=device)[None, :] <= positions[:, None]
            else:
                mask = document_mask(documents[:, start:end], documents[:, :end], positions)
            masks.append((rows, end, mask))
        return masks

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The whole sequence, in order, of ``x`` ``[B, H, t, D]`` held as this rank's chunks by every rank.

        Differentiable: the gradient of each rank's part is summed over the ranks that used it."""
        t = x.size(2)
        gathered = _GatherFirstDim.apply(x.movedim(2, 0), self.group, self.size).movedim(0, 2)
        parts = gathered.split(t, dim=2)  # rank j's part: chunks j and 2 size - 1 - j
        early = [part[:, :, :t // 2] for part in parts]
        late = [part[:, :, t // 2:] for part in reversed(parts)]
        return torch.cat(early + late, dim=2)

    def gather_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The whole sequences ``[B, T]``, in order, of token ids ``[B, t]`` held as this rank's chunks."""
        return self.gather(tokens[:, None, :, None])[:, 0, :, 0]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
               fp32: bool | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of this rank's queries ``[B, H, t, D]`` over the keys and values of the whole sequence
        (``k`` and ``v`` are this rank's, possibly with fewer heads: grouped-query attention), within the documents
        whose ids ``[B, T]`` the whole sequence's tokens have where ``documents`` gives them. Recomputed in
        backward rather than keeping the gathered keys and values."""
        if not torch.is_grad_enabled():
            return self._attend(q, k, v, dropout_p, fp32, documents)
        return checkpoint(self._attend, q, k, v, dropout_p, fp32, documents, use_reentrant=False)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
                fp32: bool | None, documents: torch.Tensor | None = None) -> torch.Tensor:
        k, v = repeat_kv_heads(q, self.gather(k), self.gather(v))
        dtype = q.dtype
        if attends_in_fp32(q, fp32):  # see disttrain.models.attention: fp32 where torch's bf16 CPU kernel is slow
            q, k, v = q.float(), k.float(), v.float()
        with torch.autocast(device_type_of(q), enabled=False):  # the inputs' dtype is the one decided above
            kernel = None if documents is not None else causal_blocks.supported(q, k, v, dropout_p)
            if kernel is not None:
                y = causal_blocks.CausalChunks.apply(q, k, v, self.chunk_rows(q.size(2)), kernel)
            else:  # documents, dropout, or inputs no kernel with a log-sum-exp takes: one masked call per chunk
                y = torch.cat([F.scaled_dot_product_attention(q[:, :, rows], k[:, :, :end], v[:, :, :end],
                                                              attn_mask=mask, dropout_p=dropout_p)
                               for rows, end, mask in self.chunk_masks(q.size(2), q.device, documents)], dim=2)
        return y.to(dtype)


def sequence_split_of(mesh: Any) -> SequenceSplit:
    """The split of this rank's place on the ``cp`` dimension of ``mesh``."""
    cp = mesh["cp"]
    return SequenceSplit(cp.get_group(), cp.get_local_rank(), cp.size())


def sequence_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that take a sequence split (they attend, or read positions)."""
    return [m for m in model.modules() if hasattr(m, "sequence_split")]


def apply_context_parallel(model: nn.Module, split: SequenceSplit) -> nn.Module:
    """Make every module of ``model`` that takes a split attend and place positions as ``split`` says."""
    modules = sequence_modules(model)
    if not modules:
        raise ValueError(f"{type(model).__name__} has no module with a sequence_split attribute")
    for module in modules:
        module.sequence_split = split
    return model
