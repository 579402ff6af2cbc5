"""The planner's pass recorder: module hooks that keep the stack of running units and charge each saved tensor,
operator and collective-crossing activation of a forward and backward on the meta device to the unit that made it
(``disttrain.plan.model_stats`` runs the pass and keeps what this records as ``ModelStats``)."""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from disttrain.plan.experts import ExpertCall, expert_modules
from disttrain.plan.ops import KINDS, Op

ROOT = ""
"""Unit name of everything outside the named units (embeddings, final norm, head of a model without them)."""


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
        for t in outputs:
            self._producer[t.untyped_storage()._cdata] = kind
        if kind != "other":
            self.selective[self.stack[-1]] += sum(t.untyped_storage().nbytes() for t in outputs)
            if self._mixture_depth:
                self.mixture[self.stack[-1]]["selective"] += sum(t.untyped_storage().nbytes() for t in outputs)
        if kind == "attention":  # query, key, value come first in every fused kernel's arguments
            self.attention_kv[self.stack[-1]].append(nbytes(args[0][1]) + nbytes(args[0][2]))

    def on_op(self, op: Op) -> None:
        """An operator ran: charge it to the running unit (forward) or to backward."""
        (self.forward_ops[self.stack[-1]] if self._in_forward else self.backward_ops).append(op)
        if self._in_forward and self._mixture_depth:
            self.mixture_ops[self.stack[-1]].append(op)

    def __enter__(self) -> PassRecorder:
        for name in self.units:
            module = self.net.get_submodule(name)
            self._handles.append(module.register_forward_pre_hook(self._enter_unit(name)))
            self._handles.append(module.register_forward_hook(self._leave_unit(name)))
        for pattern, style in self.tp_plan.items():
            if style not in ("colwise", "rowwise"):
                continue
            for name, module in self.net.named_modules():
                if fnmatchcase(name, pattern):
                    self._handles.append(module.register_forward_hook(self._tp_hook(style)))
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
            if self._in_forward:  # the rows to compute come first
                self.expert_calls.append(ExpertCall(name, self.stack[-1], n_experts, args[0].size(0),
                                                    nbytes(args[0]), 0))
        return hook

    def _leave_experts(self):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self._in_forward:
                self.expert_calls[-1].out_bytes = nbytes(output)
        return hook

    def _mixture(self, step: int):
        def hook(module: nn.Module, *args: Any) -> None:
            self._mixture_depth += step
        return hook

    def _tp_hook(self, style: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if style == "rowwise":
                self.tp_forward += nbytes(output)
                return
            # each column-wise module turns its input's gradient from partial sums into a whole one by its own
            # all-reduce (q, k and v separately: they are separate layers here)
            self.tp_backward += nbytes(args[0])
        return hook
