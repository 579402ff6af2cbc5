"""What a plan needs to know of a model, read from one forward and backward pass on the meta device.

The pass allocates nothing and takes well under a second for a 7B model, so a plan of any size runs here.
What it records, for one micro-batch:

- every parameter's element count and the unit that owns it (pipeline and sharding units);
- the bytes of the tensors autograd saves for backward (the activations), per unit: a storage is counted
  once, at the unit that first saved it; parameters and the input batch are not activations;
- which kind of operator produced each saved storage (a matrix product, attention, or anything else), and
  the bytes of every output of the matrix products and attention of forward: what selective activation
  checkpointing keeps (``SELECTIVE_SAVE_OPS``) and what it recomputes;
- every operator's FLOPs (``torch.utils.flop_counter``'s formulas) and the bytes of its inputs and outputs
  (views move none), forward ops per unit and backward ops in one list, for a roofline step time;
- the bytes of the keys and values of each attention call (what context parallelism gathers);
- attention as the fused kernels of CPUs and GPUs run it (they save the output and the log-sum-exp, not the
  attention matrix the meta device's reference path would keep);
- the output bytes of every pipeline unit (what crosses a stage boundary) and the activation bytes the
  tensor-parallel plan communicates: each row-wise layer's output (all-reduced in forward) and each
  input of a column-wise layer (all-reduced in backward);
- mixtures of experts (``disttrain.plan.experts``): which parameters are experts, the rows each expert module
  computed and their bytes in and out (what expert parallelism's all-to-alls move), and what a mixture (the
  module around the experts: router, experts, combination) saved and ran, which tensor parallelism does not
  split. Routing runs balanced (the meta device has no values to route by); the grouped products count
  2 x M x K x N FLOPs, which torch's counter leaves out.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

from disttrain.data.spec import DataSpec, example_batch
from disttrain.parallel import activation_checkpoint
from disttrain.plan.experts import BalancedRouting, expert_modules, expert_parameters, grouped_mm_flops

ROOT = ""
"""Unit name of everything outside the named units (embeddings, final norm, head of a model without them)."""
Op = tuple[int, int, bool, str]
"""One operator: FLOPs, bytes read and written, whether it is a convolution (CPUs run those well below
their matrix-multiply rate, so a profile times them at a rate of their own), and its kind (``op_kind``)."""
CONVOLUTIONS = {torch.ops.aten.convolution, torch.ops.aten.convolution_backward}
"""Convolution operators (timed at a profile's convolution rate)."""
# the operator sets of the runtime's selective policy, so the plan prices exactly what it keeps
MATMUL_OPS, ATTENTION_OPS = activation_checkpoint.MATMUL_OPS, activation_checkpoint.ATTENTION_OPS
SELECTIVE_SAVE_OPS = MATMUL_OPS | ATTENTION_OPS
"""Operators whose outputs selective activation checkpointing keeps (``parallel.activation_checkpoint``'s
collectives run only under tensor parallelism, which a measured pass leaves out); it recomputes the others."""
KINDS = ("matmul", "attention", "other")
"""Kinds of operator a pass tells apart (``op_kind``)."""
_aten = torch.ops.aten
FLOP_REGISTRY = {
    **flop_registry,
    # the CPU kernel's FLOPs are those of the CUDA one (same arguments first)
    _aten._scaled_dot_product_flash_attention_for_cpu: flop_registry[_aten._scaled_dot_product_flash_attention],
    _aten._scaled_dot_product_flash_attention_for_cpu_backward:
        flop_registry[_aten._scaled_dot_product_flash_attention_backward],
    _aten._grouped_mm: grouped_mm_flops,
}
"""torch's FLOP formulas, with the CPU attention kernels and the grouped matrix product of experts."""


def op_kind(packet: Any) -> str:
    """``matmul``, ``attention`` or ``other`` (element-wise work, norms, copies, views, convolutions) for an
    operator overload packet (``func._overloadpacket`` of an ``OpOverload``)."""
    if packet in MATMUL_OPS:
        return "matmul"
    return "attention" if packet in ATTENTION_OPS else "other"


@dataclass
class ExpertCall:
    """One forward of a module of grouped experts."""

    module: str
    """The expert module's name."""
    unit: str
    """The innermost tracked unit it ran in (``ROOT`` if none)."""
    n_experts: int
    """Experts it holds."""
    rows: int
    """Rows it computed (tokens x experts per token, less any dropped)."""
    in_bytes: int
    """Bytes of the rows it received (expert parallelism's dispatch all-to-all moves them)."""
    out_bytes: int
    """Bytes of the rows it returned (the combining all-to-all moves them back)."""


@dataclass
class ModelStats:
    """Sizes of one model at one micro-batch (see the module docstring)."""

    micro_size: int
    """Samples per micro-batch the pass ran with; activations and FLOPs scale linearly with it."""
    tokens_per_sample: int
    """Tokens per sample (sequence length for text, 1 for images)."""
    param_numel: dict[str, int]
    """Parameter name -> element count (a tied parameter once, under its first name)."""
    param_unit: dict[str, str]
    """Parameter name -> the innermost tracked unit that owns it (``ROOT`` if none)."""
    units: list[str]
    """Tracked unit names in forward order (pipeline units, then sharding units not among them)."""
    pipeline_units: list[str]
    """Pipeline units in order (empty: the model has none)."""
    shard_units: list[str]
    """Sharding / activation-checkpointing units."""
    saved_bytes: dict[str, int]
    """Unit name (or ``ROOT``) -> bytes autograd saved while it ran, counted at the innermost unit."""
    unit_input_bytes: dict[str, int]
    """Unit name -> bytes of its input (what a checkpointed unit keeps, and a stage boundary carries)."""
    unit_output_bytes: dict[str, int]
    """Unit name -> bytes of its output."""
    forward_ops: dict[str, list[Op]]
    """Unit name (or ``ROOT``) -> each operator (``Op``) that ran in forward inside it (innermost)."""
    backward_ops: list[Op]
    """Each operator of backward."""
    output_bytes: int
    """Bytes of the model's output (logits), which the loss keeps."""
    tp_forward_bytes: int = 0
    """Bytes all-reduced in forward under tensor parallelism (row-wise layers' outputs), whole size."""
    tp_backward_bytes: int = 0
    """Bytes all-reduced in backward under tensor parallelism (column-wise layers' inputs)."""
    tp_sharded: dict[str, bool] = field(default_factory=dict)
    """Parameter name -> split by the tensor-parallel plan (column- or row-wise)."""
    saved_by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    """Unit name -> ``saved_bytes`` split by the kind of operator that produced each saved storage (``KINDS``)."""
    selective_bytes: dict[str, int] = field(default_factory=dict)
    """Unit name -> bytes of every output of the forward operators in ``SELECTIVE_SAVE_OPS`` run inside it,
    saved for backward or not: what selective checkpointing keeps of a checkpointed unit besides its input."""
    attention_kv_bytes: dict[str, list[int]] = field(default_factory=dict)
    """Unit name -> bytes of the keys plus the values of each attention call inside it (whole sequence)."""
    largest_saved: dict[str, int] = field(default_factory=dict)
    """Unit name -> bytes of its largest saved storage: the gradient of that activation is alive beside the
    unit's activations while backward goes through it."""
    expert_params: dict[str, tuple[str, int]] = field(default_factory=dict)
    """Expert parameter name -> (its expert module, experts in it); see ``disttrain.plan.experts``."""
    expert_calls: list[ExpertCall] = field(default_factory=list)
    """Each forward of an expert module, in order."""
    mixture_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    """Unit name -> the part inside mixtures of experts of its ``saved`` bytes, its ``selective`` bytes and its
    saved bytes made by ``other`` operators (tensor parallelism leaves mixtures whole)."""
    mixture_ops: dict[str, list[Op]] = field(default_factory=dict)
    """Unit name -> the forward operators that ran inside a mixture of experts (also in ``forward_ops``)."""

    @functools.cached_property
    def recomputed_ops(self) -> dict[str, list[Op]]:
        """Unit name -> the forward operators selective checkpointing runs again in backward (all but
        ``SELECTIVE_SAVE_OPS``)."""
        return {unit: [op for op in ops if op[3] == "other"] for unit, ops in self.forward_ops.items()}

    @functools.cached_property
    def recomputed_mixture_ops(self) -> dict[str, list[Op]]:
        """Unit name -> the part of ``recomputed_ops`` that runs inside mixtures of experts."""
        return {unit: [op for op in ops if op[3] == "other"] for unit, ops in self.mixture_ops.items()}

    @property
    def params(self) -> int:
        """Parameters of the model (tied ones once)."""
        return sum(self.param_numel.values())

    @property
    def has_experts(self) -> bool:
        """Whether the model has grouped experts."""
        return bool(self.expert_params)

    @property
    def expert_counts(self) -> set[int]:
        """The numbers of experts of the model's expert modules (expert parallelism's degree divides each)."""
        return {n for _, n in self.expert_params.values()}

    @property
    def expert_param_count(self) -> int:
        """Parameters of the experts, all of them."""
        return sum(self.param_numel.get(name, 0) for name in self.expert_params)

    @property
    def active_params(self) -> float:
        """Parameters one token's forward uses: every parameter but the experts it is not routed to. Each expert
        parameter counts the share of its experts a token meets: the module's rows per token over its experts
        (top_k / n_experts for routing that drops nothing)."""
        tokens = self.micro_size * self.tokens_per_sample
        rows: dict[str, int] = {}
        for call in self.expert_calls:
            rows[call.module] = rows.get(call.module, 0) + call.rows
        active = 0.0
        for name, numel in self.param_numel.items():
            if name in self.expert_params:
                module, n_experts = self.expert_params[name]
                active += numel * rows.get(module, 0) / tokens / n_experts
            else:
                active += numel
        return active

    @property
    def forward_flops(self) -> dict[str, int]:
        """Unit name -> forward FLOPs."""
        return {unit: sum(op[0] for op in ops) for unit, ops in self.forward_ops.items()}

    @property
    def total_flops(self) -> int:
        """Forward plus backward FLOPs of the micro-batch."""
        return sum(self.forward_flops.values()) + sum(op[0] for op in self.backward_ops)

    @property
    def activation_bytes(self) -> int:
        """Bytes saved for backward in all, for one micro-batch."""
        return sum(self.saved_bytes.values())


def measure_model(net: nn.Module, spec: DataSpec, micro_size: int, pipeline_units: list[str] | None = None,
                  shard_units: list[str] | None = None, tp_plan: dict[str, str] | None = None) -> ModelStats:
    """One forward and backward of ``net`` (on the meta device; a model on the CPU is moved there first, and
    is left unchanged) on a micro-batch of ``micro_size``, recorded as ``ModelStats``."""
    if any(p.device.type != "meta" for p in net.parameters()):
        net = _meta_copy(net)
    pipeline_units, shard_units = list(pipeline_units or []), list(shard_units or [])
    units = pipeline_units + [u for u in shard_units if u not in pipeline_units]
    param_numel, param_unit = _parameters(net, units)
    recorder = _Recorder(net, units, tp_plan or {})
    inputs, targets = example_batch(spec, micro_size, "meta")
    skip = {inputs.untyped_storage()._cdata, targets.untyped_storage()._cdata}
    skip |= {p.untyped_storage()._cdata for p in net.parameters()}
    # every pass starts without gradients, as a step after zero_grad does: a gradient left by an earlier pass
    # on the same net would add an accumulating operator per parameter to this pass's backward
    kept = {p: p.grad for p in net.parameters()}
    net.zero_grad(set_to_none=True)
    try:
        # the counter sees each operator before routing's stand-ins for the meta device answer it
        routing = BalancedRouting() if expert_parameters(net) else contextlib.nullcontext()
        with recorder, _FusedAttention(), routing, _OpCounter(FLOP_REGISTRY, recorder.on_op, recorder.on_call), \
                torch.autograd.graph.saved_tensors_hooks(recorder.pack(skip), lambda t: t):
            logits = net(inputs)
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
            recorder.done_forward()
            loss.backward()
    finally:
        for p, grad in kept.items():
            p.grad = grad
    tokens = spec.block_size if spec.kind == "text" else 1
    # column-wise layers split weight and bias; row-wise layers split the weight and replicate the bias
    sharded = {name: any(fnmatchcase(name.rsplit(".", 1)[0], pattern) for pattern, style in (tp_plan or {}).items()
                         if style == "colwise" or (style == "rowwise" and not name.endswith(".bias")))
               for name in param_numel}
    return ModelStats(micro_size, tokens, param_numel, param_unit, units, pipeline_units, shard_units,
                      recorder.saved, recorder.inputs, recorder.outputs, recorder.forward_ops,
                      recorder.backward_ops, _nbytes(logits), recorder.tp_forward, recorder.tp_backward, sharded,
                      recorder.saved_by_kind, recorder.selective, recorder.attention_kv, recorder.largest,
                      expert_parameters(net), recorder.expert_calls, recorder.mixture, recorder.mixture_ops)


def _meta_copy(net: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(net).to("meta")


def _parameters(net: nn.Module, units: list[str]) -> tuple[dict[str, int], dict[str, str]]:
    numel, owner, seen = {}, {}, set()
    for name, param in net.named_parameters():  # named_parameters yields a tied parameter once
        if id(param) in seen:
            continue
        seen.add(id(param))
        numel[name] = param.numel()
        inside = [u for u in units if name.startswith(u + ".")]
        owner[name] = max(inside, key=len) if inside else ROOT
    return numel, owner


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return 0


class _Recorder:
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
            self.attention_kv[self.stack[-1]].append(_nbytes(args[0][1]) + _nbytes(args[0][2]))

    def on_op(self, op: Op) -> None:
        """An operator ran: charge it to the running unit (forward) or to backward."""
        (self.forward_ops[self.stack[-1]] if self._in_forward else self.backward_ops).append(op)
        if self._in_forward and self._mixture_depth:
            self.mixture_ops[self.stack[-1]].append(op)

    def __enter__(self) -> _Recorder:
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
            self.inputs[name] = _nbytes(args)
            self.stack.append(name)
        return hook

    def _leave_unit(self, name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            self.stack.pop()
            self.outputs[name] = _nbytes(output)
        return hook

    def _enter_experts(self, name: str, module: nn.Module):
        """A hook noting each forward of the expert module ``name``; ``_leave_experts`` adds its output."""
        n_experts = next((p.size(0) for p in module.parameters() if p.dim() == 3), 0)

        def hook(module: nn.Module, args: tuple) -> None:
            if self._in_forward:  # the rows to compute come first
                self.expert_calls.append(ExpertCall(name, self.stack[-1], n_experts, args[0].size(0),
                                                    _nbytes(args[0]), 0))
        return hook

    def _leave_experts(self):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if self._in_forward:
                self.expert_calls[-1].out_bytes = _nbytes(output)
        return hook

    def _mixture(self, step: int):
        def hook(module: nn.Module, *args: Any) -> None:
            self._mixture_depth += step
        return hook

    def _tp_hook(self, style: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if style == "rowwise":
                self.tp_forward += _nbytes(output)
                return
            # each column-wise module turns its input's gradient from partial sums into a whole one by its own
            # all-reduce (q, k and v separately: they are separate layers here)
            self.tp_backward += _nbytes(args[0])
        return hook


class _FusedAttention(torch.overrides.TorchFunctionMode):
    """Runs ``scaled_dot_product_attention`` as the fused CPU kernel, whose meta implementation saves what
    fused kernels save (on the meta device the dispatcher would pick the reference path)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or kwargs.get("enable_gqa"):
            return func(*args, **kwargs)
        names = ("attn_mask", "dropout_p", "is_causal", "scale")
        options = dict(zip(names, args[3:], strict=False)) | {k: v for k, v in kwargs.items() if k in names}
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *args[:3], dropout_p=options.get("dropout_p", 0.0), is_causal=options.get("is_causal", False),
            attn_mask=options.get("attn_mask"), scale=options.get("scale"))
        return out


class _OpCounter(TorchDispatchMode):
    """Reports each operator as an ``Op``: FLOPs by torch's formulas, the bytes it reads and writes (views:
    none), its kind; and, to ``on_call``, its kind, ``(args, kwargs)`` and outputs."""

    def __init__(self, registry: dict, on_op, on_call=None) -> None:
        super().__init__()
        self.registry, self.on_op, self.on_call = registry, on_op, on_call

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func._overloadpacket
        flops = self.registry[packet](*args, **kwargs, out_val=out) if packet in self.registry else 0
        nbytes = 0 if func.is_view else sum(t.numel() * t.element_size() for t in tree_leaves((args, kwargs, out))
                                             if isinstance(t, torch.Tensor))
        kind = op_kind(packet)
        self.on_op((int(flops), nbytes, packet in CONVOLUTIONS, kind))
        if self.on_call is not None:
            self.on_call(kind, (args, kwargs), out)
        return out


def count_ops(fn) -> list[Op]:
    """Each operator ``fn()`` runs (for calibrating a profile on the same accounting)."""
    ops: list[Op] = []
    with _OpCounter(flop_registry, ops.append):
        fn()
    return ops
