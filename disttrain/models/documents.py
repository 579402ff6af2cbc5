"""Packed windows: several documents back to back, each closed by the end-of-document token, attending only within
themselves and with positions restarting at each.

Token ``i`` of a window belongs to the document that the first end-of-document token at or after ``i`` closes (the
end token itself ends its own document): its document id is the number of end tokens before it. A token sits at
position ``i - s`` of its document, ``s`` being where the document starts in the window (the first document of a
window, a continuation, starts at 0).

A model that packs documents gives each module that attends or places positions a ``documents`` attribute: one
``PackedDocuments`` shared by all of them. The module that reads the token ids (the embedding) calls ``read`` once
per forward; the others ask it for the ids and positions of the tokens they hold. A pipeline stage that holds no
embedding is read its micro-batch's tokens by the pipeline runtime (``disttrain.parallel.pipeline.runtime``).

Attention within documents is causal attention with a block-diagonal mask over the window's keys, given to
torch's scaled dot-product attention as an additive mask in the inputs' dtype (``PackedDocuments.additive_mask``):
exact, and on the CPU faster than one causal call per document where windows hold many short documents, slower
where a long window holds a few long ones (``benchmarks/document_attention.py``, its table in
benchmarks/README.md). Built once per forward, it is the one tensor every layer keeps for backward (a boolean mask
would be turned into a float copy per layer). Under context parallelism each chunk of queries is masked by the
document ids of its own positions and of the whole sequence's keys (``disttrain.parallel.context``), recomputed in
backward rather than kept.
"""

from __future__ import annotations

import torch
from torch import nn

from disttrain.models.attention import SequenceSplit, window_document_mask


def document_ids(tokens: torch.Tensor, end_token: int) -> torch.Tensor:
    """Document id of every token of windows ``[B, T]``: the number of end tokens before it (an end token belongs
    to the document it closes)."""
    ends = (tokens == end_token).long()
    return ends.cumsum(-1) - ends


def document_positions(ids: torch.Tensor) -> torch.Tensor:
    """Position of every token in its document, from document ids ``[B, T]`` (non-decreasing along T)."""
    steps = torch.arange(ids.size(-1), device=ids.device).expand_as(ids)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[..., 1:] = ids[..., 1:] != ids[..., :-1]
    return steps - torch.where(starts, steps, 0).cummax(-1).values


def documents_of(model: nn.Module) -> PackedDocuments | None:
    """The documents the modules of ``model`` share (None: its windows are not packed)."""
    return next((m.documents for m in model.modules() if getattr(m, "documents", None) is not None), None)


class PackedDocuments:
    """The documents of the windows of the current forward pass, shared by the modules of one model."""

    def __init__(self, end_token: int) -> None:
        self.end_token = end_token
        """The token id that closes every document (the tokenizer's end-of-sequence id)."""
        self.ids: torch.Tensor | None = None
        """Document ids ``[B, T]`` of the whole windows last read (None: none read yet)."""
        self._mask: tuple[torch.Tensor, torch.Tensor] | None = None

    def read(self, tokens: torch.Tensor, split: SequenceSplit | None = None) -> None:
        """Take the document ids of token ids ``[B, t]``: whole windows, or under ``split`` this rank's part of
        them (the ids then need the tokens of the whole window, gathered over the split's ranks)."""
        if split is not None and split.size > 1:
            tokens = split.gather_tokens(tokens)
        self.ids = document_ids(tokens, self.end_token)
        self._mask = None

    def current(self) -> torch.Tensor:
        """The document ids of the windows last read; RuntimeError when none was."""
        if self.ids is None:
            raise RuntimeError("no window's documents were read before attention (the model's forward, or the "
                               "pipeline runtime for its stages, reads them)")
        return self.ids

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """The causal mask within the documents of the windows last read, ``[B, 1, T, T]`` of 0 and -inf in
        ``dtype``: built once for all the layers of a forward, which then keep one tensor for backward."""
        ids = self.current()
        if self._mask is None or self._mask[0] is not ids or self._mask[1].dtype != dtype:
            self._mask = (ids, window_document_mask(ids, dtype))
        return self._mask[1]

    def mask_bytes(self) -> int:
        """Bytes of the mask last built (0: none was)."""
        return 0 if self._mask is None else self._mask[1].numel() * self._mask[1].element_size()

    def positions(self, split: SequenceSplit | None = None) -> torch.Tensor:
        """Positions ``[B, t]`` in their documents of this rank's tokens (all of them without a split)."""
        positions = document_positions(self.current())
        return positions if split is None or split.size == 1 else split.split(positions)
