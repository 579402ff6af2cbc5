"""bf16 autocast on the meta device, so that the planner's pass records each tensor in the dtype a ``bf16-mixed``
step really keeps it in.

torch's autocast does not touch meta tensors (its kernels cast only tensors on their own device, CPU or CUDA),
and a pass in fp32 scaled by a half is wrong both ways: autocast keeps the fp32 residual stream, the fp32
log-softmax of the loss and a bf16 copy of every weight it casts, and on a GPU runs norms, softmax and pointwise
exponentials in fp32. ``MetaAutocast`` is a torch-function mode that does to meta tensors what autocast does to
real ones, at the same level: an operator on one of autocast's lists (torch's ``autocast_mode.h`` and
``autocast_mode.cpp``, torch 2.11) gets its floating inputs cast before it runs, and what it calls inside runs as
given, as autocast redispatches with itself excluded. Casts of fp32 leaves that require gradients (the weights)
are cached until the mode ends, as autocast caches them until its context exits.

The lists differ by device: ``cuda`` runs layer and RMS norms, softmax, ``exp``, ``pow`` and the like in fp32,
the CPU only the losses and a few numerical routines. Where the pass follows one device, a model that branches
on its tensors' device (CPU attention in fp32 at short sequences) takes its other branch: the meta device is
neither, unless the pass says which one its meta tensors stand for
(``disttrain.models.attention.meta_tensors_stand_for``). A region a model turns autocast off in (that fp32
attention) runs uncast here too under the CPU's lists: the mode holds the CPU's own autocast on while it runs (it
casts no meta tensor) and reads it. CUDA's cannot be turned on without a GPU, and no model turns it off there.

Every weight's copy is noted (``MetaAutocast.copies``), frozen ones too: autocast caches only the copies of weights
that require gradients, and makes a frozen fp32 weight's (a LoRA base kept in fp32) again at each use, but a
product saves it for its input's gradient all the same, one per layer whatever the tokens.

The cross-entropy differs most, and it is the largest tensor of a language model's step. The CPU lists it: the
bf16 logits are cast to fp32 and its log-softmax (fp32) is kept for backward, whose gradients start in fp32 (the
log-probabilities', then the logits'). CUDA does not list it, so it runs as torch composes it: a log-softmax
told to keep the logits' dtype (autocast leaves an explicit dtype alone), kept in bf16, then ``nll_loss``, which
CUDA lists, on an fp32 copy of it that ``nll_loss`` keeps too; backward starts with that copy's fp32 gradient,
and the rest of it is bf16. Per element of the logits, the CPU keeps 4 bytes and starts backward with 8 more;
CUDA keeps 6 and starts backward with 4 more.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

_LOWER_COMMON = {
    "linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "linalg_vecdot", "prelu",
    "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
    "convolution", "_convolution", "scaled_dot_product_attention",
}
_LOSSES = {
    "cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "kl_div",
    "binary_cross_entropy_with_logits", "poisson_nll_loss", "cosine_embedding_loss", "hinge_embedding_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
}
POLICIES: dict[str, dict[str, set[str]]] = {
    "cuda": {
        "lower": _LOWER_COMMON | {"addmv", "addr", "einsum", "mv", "chain_matmul", "linalg_multi_dot",
                                  "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"},
        # cross_entropy is on no CUDA list: the mode runs it as torch composes it (``_cross_entropy``)
        "fp32": _LOSSES | {
            "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal",
            "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "rms_norm", "group_norm", "cosine_similarity",
            "dist", "pdist", "cdist", "renorm", "logsumexp", "interpolate"},
        # these take a dtype, and autocast asks for fp32 output
        "fp32_output": {"prod", "softmax", "log_softmax", "cumprod", "cumsum", "sum", "norm", "linalg_vector_norm",
                        "linalg_matrix_norm"},
        "promote": {"addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sample", "index_put",
                    "tensordot", "scatter_add"},
    },
    "cpu": {
        "lower": _LOWER_COMMON,
        "fp32": _LOSSES | {"prod", "cdist", "trace", "grid_sample", "avg_pool3d", "max_pool3d",
                           "adaptive_avg_pool3d", "stft", "quantile", "nanquantile", "polar"},
        "fp32_output": set(),
        "promote": set(),
    },
}
"""Device type -> autocast's policy -> the names of the operators it applies to, as torch functions call them
(``F.cross_entropy`` stands for ``aten::cross_entropy_loss``, ``Tensor.__matmul__`` for ``aten::matmul``)."""
_NAMES = {"__matmul__": "matmul", "__rmatmul__": "matmul", "__rpow__": "pow"}
_CROSS_ENTROPY = inspect.signature(F.cross_entropy)


def _floating(value: Any) -> bool:
    # autocast leaves float64 alone
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != torch.float64


class MetaAutocast(TorchFunctionMode):
    """Autocast to ``dtype`` with the operator lists of ``device_type`` (``cuda`` or ``cpu``), for any tensor (see
    the module docstring). ``copies``: storage key -> each low-precision copy made of a weight (a parameter,
    frozen or not, or a view of one), kept alive while the mode is: what autocast adds where parameters are
    fp32, and what FSDP2 spares when it gathers them in bf16."""

    def __init__(self, device_type: str, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.dtype = dtype
        policy = POLICIES[device_type]
        self.policy_of = {name: kind for kind, names in policy.items() for name in names}
        self.composed_cross_entropy = device_type == "cuda"  # on no CUDA list: runs as its parts (docstring)
        self.copies: dict[int, torch.Tensor] = {}
        self._cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # the CPU's own autocast, held on while the mode runs, tells where a model turned autocast off
        self._device_autocast = torch.autocast("cpu", dtype=dtype) if device_type == "cpu" else None

    def __enter__(self):
        if self._device_autocast is not None:
            self._device_autocast.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self._device_autocast is not None:
                self._device_autocast.__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        kind = self.policy_of.get(_NAMES.get(name, name))
        if kind is None or (self._device_autocast is not None and not torch.is_autocast_enabled("cpu")):
            return func(*args, **kwargs)
        if name == "cross_entropy" and self.composed_cross_entropy:
            return self._cross_entropy(func, args, kwargs)
        if kind == "lower":
            target = self.dtype
        elif kind == "fp32" or kind == "fp32_output":
            target = torch.float32
        else:  # promote: the widest floating dtype among the inputs
            dtypes = [t.dtype for t in _tensors((args, kwargs)) if _floating(t)]
            target = torch.float32 if torch.float32 in dtypes else None
        if target is None:
            return func(*args, **kwargs)
        if kind == "fp32_output":  # the first input decides (autocast passes dtype=float32 for it)
            first = next(iter(_tensors(args)), None)
            explicit = "dtype" in kwargs or any(isinstance(a, torch.dtype) for a in args)  # autocast keeps it
            if first is None or not _floating(first) or first.dtype == torch.float32 or explicit:
                return func(*args, **kwargs)
            return func(first.float(), *args[1:], **kwargs)
        return func(*self._cast_all(args, target), **{k: self._cast_all(v, target) for k, v in kwargs.items()})

    def _cross_entropy(self, func, args: tuple, kwargs: dict) -> torch.Tensor:
        """``F.cross_entropy`` as torch composes it where autocast does not list it: ``nll_loss`` (fp32) of a
        log-softmax in the logits' own dtype. Probability targets and label smoothing compose otherwise; they
        run in fp32, as the CPU runs them."""
        given = _CROSS_ENTROPY.bind(*args, **kwargs)
        given.apply_defaults()
        a = given.arguments
        logits, target = a["input"], a["target"]
        if not _floating(logits) or logits.dtype == torch.float32:
            return func(*args, **kwargs)
        if target.is_floating_point() or a["label_smoothing"] > 0:
            return func(*self._cast_all(args, torch.float32),
                        **{k: self._cast_all(v, torch.float32) for k, v in kwargs.items()})
        log_probs = torch.log_softmax(logits, 0 if logits.dim() == 1 else 1, dtype=logits.dtype)
        return F.nll_loss(log_probs.float(), target, self._cast_all(a["weight"], torch.float32),
                          ignore_index=a["ignore_index"], reduction=a["reduction"])

    def _cast_all(self, value: Any, target: torch.dtype) -> Any:
        if isinstance(value, (tuple, list)):
            return type(value)(self._cast_all(v, target) for v in value)
        if not _floating(value) or value.dtype == target:
            return value
        return self._cast(value, target)

    def _cast(self, t: torch.Tensor, target: torch.dtype) -> torch.Tensor:
        weight = isinstance(t, nn.Parameter) or isinstance(t._base, nn.Parameter)
        # autocast caches the low-precision casts of fp32 leaves (not of views of them) until it exits
        cached = target == self.dtype and t.dtype == torch.float32 and t.requires_grad and t.is_leaf
        if cached and id(t) in self._cache:
            return self._cache[id(t)][1]
        out = t.to(target)
        if cached:
            self._cache[id(t)] = (t, out)
        if weight and target == self.dtype:
            self.copies[out.untyped_storage()._cdata] = out
        return out


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
