"""Causal scaled dot-product attention that runs in fp32 where torch's bf16 kernel is the slow one.

torch's CPU flash-attention backward in bf16 is slower than in fp32 at short sequences and narrow heads and
faster at long sequences and wide heads (``benchmarks/attention_dtype.py``), and a small GPT trained under bf16
autocast slower than fp32 with that kernel and faster without it (benchmarks/README.md, Figures cited
elsewhere). So under bf16 a CPU attention with ``T * head_dim`` below ``FP32_BELOW`` casts its inputs up,
attends in fp32 and casts the result back; every matrix product around it stays bf16.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

import torch
import torch.nn.functional as F

FP32_BELOW = 16384
"""On a CPU, bf16 attention with sequence length times head width below this runs in fp32 (see above)."""

_META_STANDS_FOR: ContextVar[str] = ContextVar("meta_stands_for", default="meta")


@contextmanager
def meta_tensors_stand_for(device_type: str) -> Iterator[None]:
    """Within it, attention on meta tensors decides as on ``device_type`` (``cpu`` or ``cuda``): the planner's
    pass on the meta device stands for the device it plans for, and a CPU attends in fp32 where a GPU does not."""
    token = _META_STANDS_FOR.set(device_type)
    try:
        yield
    finally:
        _META_STANDS_FOR.reset(token)


def device_type_of(q: torch.Tensor) -> str:
    """The device type ``q``'s attention decides by: its own, or for a meta tensor the one it stands for
    (``meta_tensors_stand_for``)."""
    return _META_STANDS_FOR.get() if q.is_meta else q.device.type


class SequenceSplit(Protocol):
    """What a model's modules ask of a sequence split over ranks (``disttrain.parallel.context`` builds it)."""

    def positions(self, local_length: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Global positions of this rank's ``local_length`` tokens."""
        ...

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
               fp32: bool | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of this rank's queries over the whole sequence's keys and values (within the
        documents whose ids ``[B, T]`` the whole sequence's tokens have, where given)."""
        ...

    def split(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a whole-sequence ``tensor`` (sequence along ``dim``)."""
        ...

    def gather_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """The whole sequences ``[B, T]``, in order, of token ids ``[B, t]`` held as this rank's part."""
        ...

    @property
    def size(self) -> int:
        """Ranks each sequence is split over."""
        ...

    def total(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum of ``tensor`` (no gradient) over the ranks holding parts of the same sequences."""
        ...


class Documents(Protocol):
    """What attention asks of the documents of packed windows (``disttrain.models.documents`` keeps them)."""

    def current(self) -> torch.Tensor:
        """Document ids ``[B, T]`` of the whole windows of the current forward."""
        ...

    def additive_mask(self, dtype: torch.dtype) -> torch.Tensor:
        """Their causal block-diagonal mask ``[B, 1, T, T]`` to add to the scores in ``dtype`` (0 or -inf), one
        tensor for every layer of the forward."""
        ...


def positions_of(length: int, device: torch.device, split: SequenceSplit | None) -> torch.Tensor:
    """Positions of a module's ``length`` tokens in their sequence: ``0 .. length-1``, or where a split puts them."""
    return torch.arange(length, device=device) if split is None else split.positions(length, device)


def repeat_kv_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values with as many heads as ``q`` (grouped-query attention: query head h reads key/value head
    h // group, consecutive query heads share one)."""
    group = q.size(1) // k.size(1)
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def attends_in_fp32(q: torch.Tensor, fp32: bool | None = None) -> bool:
    """Whether attention on queries ``q`` ``[B, H, T, D]`` runs in fp32.

    ``fp32`` True or False forces the choice for bf16 inputs; None applies the CPU rule of this module.
    Inputs that are not bf16 attend in their own dtype.
    """
    if q.dtype != torch.bfloat16:
        return False
    if fp32 is not None:
        return fp32
    return device_type_of(q) == "cpu" and q.size(-2) * q.size(-1) < FP32_BELOW


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0, fp32: bool | None = None,
    split: SequenceSplit | None = None, documents: Documents | None = None,
) -> torch.Tensor:
    """Causal ``scaled_dot_product_attention`` of ``[B, H, T, D]`` inputs, in fp32 where ``attends_in_fp32``.
    ``k`` and ``v`` may have fewer heads than ``q`` (grouped-query attention). With a ``split`` the inputs are
    this rank's tokens of a sequence split over ranks, and attention covers the whole sequence. With the
    ``documents`` of packed windows a token attends only within its own document (``disttrain.models.documents``).
    """
    if split is not None:
        return split.attend(q, k, v, dropout_p, fp32, None if documents is None else documents.current())
    k, v = repeat_kv_heads(q, k, v)
    if not attends_in_fp32(q, fp32):
        return _attend(q, k, v, dropout_p, documents)
    # autocast would cast the fp32 inputs straight back to bf16: attention is on its lower-precision list
    with torch.autocast(device_type_of(q), enabled=False):
        y = _attend(q.float(), k.float(), v.float(), dropout_p, documents)
    return y.to(q.dtype)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float,
            documents: Documents | None) -> torch.Tensor:
    """Causal attention over the whole sequence, or within each of the ``documents``."""
    if documents is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    # an additive mask of the inputs' dtype is kept for backward as it is, one for every layer, where a boolean
    # one is turned into a float copy kept by each layer
    return F.scaled_dot_product_attention(q, k, v, attn_mask=documents.additive_mask(q.dtype), dropout_p=dropout_p)


def document_mask(query_ids: torch.Tensor, key_ids: torch.Tensor, query_positions: torch.Tensor) -> torch.Tensor:
    """``[B, 1, Tq, Tk]`` boolean mask (True: attended) of queries with document ids ``query_ids`` ``[B, Tq]`` at
    window positions ``query_positions`` ``[Tq]`` over the keys ``0 .. Tk-1`` with ids ``key_ids`` ``[B, Tk]``:
    causal, and within a document."""
    keys = torch.arange(key_ids.size(-1), device=key_ids.device)
    causal = keys[None, :] <= query_positions[:, None]
    return ((query_ids[:, :, None] == key_ids[:, None, :]) & causal)[:, None]


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The boolean ``mask`` (True: attended) as 0 and -inf in ``dtype``, to add to attention scores."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def window_document_mask(ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive causal mask ``[B, 1, T, T]`` within the documents whose ids ``[B, T]`` a window's tokens have."""
    return additive_mask(document_mask(ids, ids, torch.arange(ids.size(-1), device=ids.device)), dtype)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor,
                       dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of ``[B, H, T, D]`` inputs (as many key/value heads as query heads) within the documents
    whose ids ``[B, T]`` each token has."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=window_document_mask(ids, q.dtype), dropout_p=dropout_p)
