"""The planner's pass recorder: module hooks that keep the stack of running units and charge each saved tensor,
operator and collective-crossing activation of a forward and backward on the meta device to the unit that made it
(``disttrain.plan.model_stats`` runs the pass and keeps what this records as ``ModelStats``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from disttrain.plan.experts import ExpertCall, expert_modules
from disttrain.plan.ops import KINDS, Op

ROOT = ""
"""Unit name of everything outside the named units (embeddings, final norm, head of a model without them)."""

GATHERING_STYLES = ("colwise_gather", "rowwise_whole_input")
"""Tensor-parallel styles with whole activations on either side: a block holding them keeps whole, on every tp rank,
what Megatron's analysis has split (the attention between a gathered qkv and a row-wise output, for one)."""

SPLIT_WORK_STYLES = ("colwise", "rowwise", "colwise_gather", "rowwise_whole_input", "experts")
"""Tensor-parallel styles whose modules' work each tp rank does a 1/tp of (the ``experts`` style: the rows of its
own experts); ``per_head`` and ``mla_kv_a`` modules run whole, and the sequence styles split no work."""


def nbytes(value: Any) -> int:
    """Bytes of a tensor, or of the tensors of a tuple or list (nested); 0 for anything else."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(nbytes(v) for v in value)
    return 0



class PassRecorder:
    """Module hooks that keep the stack of running units and charge saved bytes and FLOPs to its top."""

    def __init__(self, net: nn.Module, units: list[str], tp_plan: dict[str, str]) -> None:
        self.net, self.units, self.tp_plan = net, units, tp_plan
        self.stack: list[str] = [ROOT]
        self.saved: dict[str, int] = dict.fromkeys([ROOT, *units], 0)
        self.saved_by_kind: dict[str, dict[str, int]] = {unit: dict.fromkeys(KINDS, 0) for unit in [ROOT, *units]}
        self.largest: dict[str, int] = dict.fromkeys([ROOT, *units], 0)
        self.selective: dict[str, int] = dict.fromkeys([ROOT, *units], 0)
        self.attention_kv: dict[str, list[int]] = {unit: [] for unit in [ROOT, *units]}
        self._producer: dict[int, str] = {}
        self.forward_ops: dict[str, list[Op]] = {unit: [] for unit in [ROOT, *units]}
        self.backward_ops: list[Op] = []
        self.inputs: dict[str, int] = {}
        self.outputs: dict[str, int] = {}
        self.tp_forward = self.tp_backward = 0
        self.tp_forward_gather = self.tp_backward_gather = self.tp_weight_grads = 0
        self._split_depth = 0
        # tensor parallelism's split activations, followed from each column-wise output through the operators
        # that read them, up to the row-wise (or gathering) output that makes them whole again
        self._tp_split: set[int] = set()
        self.tp_split: dict[str, dict[str, int]] = {unit: dict.fromkeys(("saved", "selective", "other"), 0)
                                                    for unit in [ROOT, *units]}
        self.tp_gathering_units: set[str] = set()
        self.tp_whole_ops: dict[str, list[Op]] = {unit: [] for unit in [ROOT, *units]}
        self.expert_calls: list[ExpertCall] = []
        self.mixture: dict[str, dict[str, int]] = {unit: dict.fromkeys(("saved", "selective", "other"), 0)
                                                   for unit in [ROOT, *units]}
        self.mixture_ops: dict[str, list[Op]] = {unit: [] for unit in [ROOT, *units]}
        self._mixture_depth = 0
        self.copies: dict[int, torch.Tensor] = {}
        self.on_saved = None
        self.weight_copies: dict[str, int] = dict.fromkeys([ROOT, *units], 0)
        self._seen: set[int] = set()
        self._in_forward, self._handles = True, []

    def pack(self, skip: set[int]):
        def hook(tensor: torch.Tensor) -> torch.Tensor:
            key = tensor.untyped_storage()._cdata
            if self._in_forward and key not in skip and key not in self._seen:
                self._seen.add(key)
                nbytes = tensor.untyped_storage().nbytes()
                self.saved[self.stack[-1]] += nbytes
                self.largest[self.stack[-1]] = max(self.largest[self.stack[-1]], nbytes)
                self.saved_by_kind[self.stack[-1]][self._producer.get(key, "other")] += nbytes
                if key in self.copies:
                    self.weight_copies[self.stack[-1]] += nbytes
                if self.on_saved is not None:
                    self.on_saved(tensor.untyped_storage())
                if self._mixture_depth:
                    self.mixture[self.stack[-1]]["saved"] += nbytes
                    if self._producer.get(key, "other") == "other":
                        self.mixture[self.stack[-1]]["other"] += nbytes
                if key in self._tp_split:
                    self.tp_split[self.stack[-1]]["saved"] += nbytes
                    if self._producer.get(key, "other") == "other":
                        self.tp_split[self.stack[-1]]["other"] += nbytes
            return tensor
        return hook

    def on_call(self, kind: str, args: tuple, out: Any) -> None:
        """An operator returned ``out``: note which kind made each new storage (a later operator may make a new
        storage where a freed one was, so the latest maker counts), and under forward what selective
        checkpointing would keep of it."""
        if not self._in_forward:
            return
        # views and in-place operators return their input's storage (not every view says so in its schema:
        # ``_unsafe_view``, which bias-free ``linear`` ends with, does not)
        given = {t.untyped_storage()._cdata for t in tree_leaves(args) if isinstance(t, torch.Tensor)}
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)
                   and t.untyped_storage()._cdata not in given]
        split = not given.isdisjoint(self._tp_split)
        if not split and not self._split_depth and self.forward_ops[self.stack[-1]]:
            # ``on_op`` has just charged this operator: it reads whole activations outside any split layer
            self.tp_whole_ops[self.stack[-1]].append(self.forward_ops[self.stack[-1]][-1])
        for t in outputs:
            self._producer[t.untyped_storage()._cdata] = kind
            (self._tp_split.add if split else self._tp_split.discard)(t.untyped_storage()._cdata)
        if kind != "other":
            self.selective[self.stack[-1]] += sum(t.untyped_storage().nbytes() for t in outputs)
            if split:
                self.tp_split[self.stack[-1]]["selective"] += sum(t.untyped_storage().nbytes() for t in outputs)
            if self._mixture_depth:
                self.mixture[self.stack[-1]]["selective"] += sum(t.untyped_storage().nbytes() for t in outputs)
        if kind == "attention":  # query, key, value come first in every fused kernel's arguments
            self.attention_kv[self.stack[-1]].append(nbytes(args[0][1]) + nbytes(args[0][2]))

    def on_op(self, op: Op) -> None:
        """An operator ran: charge it to the running unit (forward) or to backward."""
        (self.forward_ops[self.stack[-1]] if self._in_forward else self.backward_ops).append(op)
        if self._in_forward and self._mixture_depth and not self._split_depth:
            self.mixture_ops[self.stack[-1]].append(op)

    def __enter__(self) -> PassRecorder:
        for name in self.units:
            module = self.net.get_submodule(name)
            self._handles.append(module.register_forward_pre_hook(self._enter_unit(name)))
            self._handles.append(module.register_forward_hook(self._leave_unit(name)))
        from disttrain.parallel.model_plan import matching_modules

        for pattern, style in self.tp_plan.items():
            for name in matching_modules(self.net, pattern):
                module = self.net.get_submodule(name)
                parent = self.net.get_submodule(name.rsplit(".", 1)[0]) if "." in name else self.net
                rope = getattr(parent, "qk_rope_head_dim", 0)  # multi-head latent attention's shared key
                self._handles.append(module.register_forward_hook(self._tp_hook(style, module, rope)))
                if style == "rowwise_whole_input":
                    self._handles.append(module.register_forward_pre_hook(self._slice_input))
                if style in SPLIT_WORK_STYLES:
                    self._handles.append(module.register_forward_pre_hook(self._split(1)))
                    self._handles.append(module.register_forward_hook(self._split(-1), always_call=True))
        for name, module in expert_modules(self.net).items():
            self._handles.append(module.register_forward_pre_hook(self._enter_experts(name, module)))
            self._handles.append(module.register_forward_hook(self._leave_experts()))
            # the mixture is the module around the experts (router and combination); the experts alone if the
            # model is nothing else
            mixture = self.net.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
            self._handles.append(mixture.register_forward_pre_hook(self._mixture(1)))
            self._handles.append(mixture.register_forward_hook(self._mixture(-1), always_call=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()

    def done_forward(self) -> None:
        """Forward ended: later saves (in backward) are not activations."""
        self._in_forward = False

    def _enter_unit(self, name: str):
        def hook(module: nn.Module, args: tuple) -> None:
            self.inputs[name] = nbytes(args)
            self.stack.append(name)
        return hook

    def _leave_unit(self, name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self.stack.pop()
            self.outputs[name] = nbytes(output)
        return hook

    def _enter_experts(self, name: str, module: nn.Module):
        """A hook noting each forward of the expert module ``name``; ``_leave_experts`` adds its output."""
        n_experts = next((p.size(0) for p in module.parameters() if p.dim() == 3), 0)

        def hook(module: nn.Module, args: tuple) -> None:
            if not self._in_forward:
                return
            rows = args[0]
            choices = args[1] if len(args) == 3 else None
            if isinstance(choices, torch.Tensor) and choices.dim() == 2 and choices.size(0) == rows.size(0):
                # ``transformers``' experts take each token once with its chosen experts ``[tokens, top_k]``: they
                # compute, and expert parallelism exchanges, a row per token and chosen expert
                routed = rows.size(0) * args[1].size(-1)
                self.expert_calls.append(ExpertCall(name, self.stack[-1], n_experts, routed,
                                                    routed * rows[0].numel() * rows.element_size(), 0))
                return
            # disttrain's grouped experts take the routed rows themselves, sorted by expert
            self.expert_calls.append(ExpertCall(name, self.stack[-1], n_experts, rows.size(0), nbytes(rows), 0))
        return hook

    def _leave_experts(self):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self._in_forward:  # the rows computed, each as wide as an output row (a token's, for transformers')
                call = self.expert_calls[-1]
                call.out_bytes = call.rows * output[0].numel() * output.element_size()
        return hook

    def _mixture(self, step: int):
        def hook(module: nn.Module, *args: Any) -> None:
            self._mixture_depth += step
        return hook

    def _split(self, step: int):
        def hook(module: nn.Module, *args: Any) -> None:
            self._split_depth += step
        return hook

    def _slice_input(self, module: nn.Module, args: tuple) -> None:
        """A row-wise layer on a whole input keeps only its slice for backward (what the runtime cuts from the
        whole): counted as split, as the whole is when nothing else keeps it."""
        if self._in_forward and args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
            self._tp_split.add(args[0].untyped_storage()._cdata)

    def _tp_hook(self, style: str, module: nn.Module, rope_width: int = 0):
        """A hook adding what a module of tensor-parallel ``style`` communicates (``disttrain.parallel.tp``,
        ``disttrain.parallel.tp_styles``) to the whole-size bytes of its kind: all-reduced in forward (a row-wise
        split's partial outputs, the experts' partial sums), all-reduced in backward (the partial gradients of a
        column-wise split's input, or of the experts' tokens and routing weights, or of multi-head latent
        attention's shared rotary key), all-gathered in forward (a gathered column-wise output) or in backward
        (the gradient of a whole input a row-wise split used a slice of), and the gradients of whole weights
        summed over the tp ranks (``per_head``)."""
        if style == "per_head":
            self.tp_weight_grads += sum(nbytes(p) for p in module.parameters())

        def grad_bytes(value: Any) -> int:  # token ids and routing choices carry no gradient
            return nbytes(value) if isinstance(value, torch.Tensor) and value.is_floating_point() else 0

        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if not self._in_forward or not args:
                return
            if style in GATHERING_STYLES:
                self.tp_gathering_units.add(self.stack[-1])
            if style in SPLIT_WORK_STYLES:  # a column-wise output is split; the others' outputs are whole
                keys = {t.untyped_storage()._cdata for t in tree_leaves(output) if isinstance(t, torch.Tensor)}
                self._tp_split.update(keys) if style == "colwise" else self._tp_split.difference_update(keys)
            if style in ("rowwise", "rowwise_whole_input", "experts"):
                self.tp_forward += nbytes(output)
            if style in ("colwise", "colwise_gather"):
                # each column-wise module turns its input's gradient from partial sums into a whole one by its
                # own all-reduce (q, k and v separately: they are separate layers here)
                self.tp_backward += grad_bytes(args[0])
            if style == "experts":
                self.tp_backward += grad_bytes(args[0]) + grad_bytes(args[2] if len(args) > 2 else None)
            if style == "colwise_gather":
                self.tp_forward_gather += nbytes(output)
            if style == "rowwise_whole_input":
                self.tp_backward_gather += grad_bytes(args[0])
            if style == "mla_kv_a":
                self.tp_backward += nbytes(output) * rope_width // output.size(-1)
        return hook
