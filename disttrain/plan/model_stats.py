"""What a plan needs to know of a model, read from one forward and backward pass on the meta device.

The pass allocates nothing and takes well under a second for a 7B model, so a plan of any size runs here.
What it records, for one micro-batch:

- every parameter's element count and the unit that owns it (pipeline and sharding units);
- the bytes of the tensors autograd saves for backward (the activations), per unit: a storage is counted
  once, at the unit that first saved it; parameters and the input batch are not activations;
- which kind of operator produced each saved storage (a matrix product, attention, or anything else), and
  the bytes of every output of the matrix products and attention of forward: what selective activation
  checkpointing keeps (``ops.SELECTIVE_SAVE_OPS``) and what it recomputes;
- every operator's FLOPs (``torch.utils.flop_counter``'s formulas) and the bytes of its inputs and outputs
  (views move none), forward ops per unit and backward ops in one list, for a roofline step time;
- the bytes of the keys and values of each attention call (what context parallelism gathers);
- attention as the fused kernels of CPUs and GPUs run it (they save the output and the log-sum-exp, not the
  attention matrix the meta device's reference path would keep), grouped-query attention with keys and values
  whole, a boolean mask as the additive one torch makes of it for each call (``ops.FusedAttention``); a model's
  checks of the batch's values (which the meta device has not) answered as whole, unpadded sequences answer them
  (``data_checks.WholeSequences``: ``transformers`` asks so before it builds a mask);
- the output bytes of every pipeline unit (what crosses a stage boundary) and the activation bytes the
  tensor-parallel plan communicates, style by style (``recorder.PassRecorder._tp_hook``): each row-wise layer's
  output (all-reduced in forward) and each input of a column-wise layer (all-reduced in backward), the gathered
  outputs and whole inputs of ``colwise_gather`` and ``rowwise_whole_input`` layers, the partial sums of experts
  split whole over the tp ranks, and the parameters each style splits (``SHARDING_STYLES``);
- mixtures of experts (``disttrain.plan.experts``): which parameters are experts, the rows each expert module
  computed (tokens x top_k, whether it takes the routed rows or, as ``transformers``' do, each token with its
  chosen experts) and their bytes in and out (what expert parallelism's all-to-alls move), and what a mixture (the
  module around the experts: router, experts, combination) saved and ran, which tensor parallelism does not
  split (but for the work of modules a tp style splits inside it: experts split whole over the tp ranks compute
  only their own rows). Routing runs balanced (the meta device has no values to route by); the grouped products count
  2 x M x K x N FLOPs, which torch's counter leaves out;
- for a ``bf16-mixed`` run, all of it as autocast makes it (``disttrain.plan.autocast``): every tensor in the dtype
  autocast gives it, the bf16 copies of the weights among the saved tensors, and what the loss's backward
  adds to what is saved before the logits' gradient is complete (its gradients, fp32 ones among them, less what
  it frees by then);
- a QLoRA base (``model.lora.base_dtype=nf4``) as a rank holds and runs it: the pass quantises a copy of the model's
  adapted layers (``disttrain.models.nf4``, on the meta device too), which keep nothing for backward but their codes
  (a parameter: no bf16 copy of the weight), return their input's dtype and count the FLOPs of the product with the
  dequantised weight (``ops.LIBRARY_FLOPS``); each is held at its codes and absmax per weight, and the dequantised
  bf16 weight of the largest is a transient of backward (``ModelStats.dequantised_bytes``).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from disttrain.data.spec import DataSpec, example_batch
from disttrain.models.attention import meta_tensors_stand_for
from disttrain.models.documents import documents_of
from disttrain.models.nf4 import QUANTISE_BASE, NF4Linear, nf4_layers, quantise_adapted_bases
from disttrain.observe.tensor_bytes import LiveStorages
from disttrain.plan.autocast import MetaAutocast
from disttrain.plan.data_checks import WholeSequences
from disttrain.plan.experts import BalancedRouting, ExpertCall, expert_parameters
from disttrain.plan.measure import cross_entropy
from disttrain.plan.ops import FLOP_REGISTRY, FusedAttention, Op, OpCounter
from disttrain.plan.recorder import ROOT, PassRecorder, nbytes


@dataclass
class ModelStats:
    """Sizes of one model at one micro-batch (see the module docstring)."""

    micro_size: int
    """Samples per micro-batch the pass ran with; activations and FLOPs scale linearly with it."""
    tokens_per_sample: int
    """Tokens per sample (sequence length for text, 1 for images)."""
    param_numel: dict[str, int]
    """Parameter name -> element count (a tied parameter once, under its first name; the codes of a layer held
    quantised, QLoRA's nf4 base: the weights they hold)."""
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
    """Bytes all-reduced in backward under tensor parallelism (column-wise layers' inputs), whole size."""
    tp_sharded: dict[str, bool] = field(default_factory=dict)
    """Parameter name -> split by the tensor-parallel plan (``SHARDING_STYLES``)."""
    saved_by_kind: dict[str, dict[str, int]] = field(default_factory=dict)
    """Unit name -> ``saved_bytes`` split by the kind of operator that produced each saved storage (``KINDS``)."""
    selective_bytes: dict[str, int] = field(default_factory=dict)
    """Unit name -> bytes of every output of the forward operators in ``ops.SELECTIVE_SAVE_OPS`` run inside it,
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
    """Unit name -> the forward operators that ran inside a mixture of experts (also in ``forward_ops``), but for
    those of modules a tp style splits there: what every tp rank runs whole."""
    autocast: str | None = None
    """The device whose bf16 autocast the pass ran under (``cuda`` or ``cpu``); None: fp32. Under it every byte
    above is in the dtype autocast keeps it in."""
    weight_copy_bytes: dict[str, int] = field(default_factory=dict)
    """Unit name -> the part of ``saved_bytes`` that is autocast's bf16 copies of weights (none where the
    parameters are bf16 already, as FSDP2 gathers them under bf16-mixed on a GPU)."""
    tp_forward_gather_bytes: int = 0
    """Bytes all-gathered in forward under tensor parallelism (``colwise_gather`` layers' outputs), whole size."""
    tp_backward_gather_bytes: int = 0
    """Bytes all-gathered in backward under tensor parallelism (the gradients of ``rowwise_whole_input`` layers'
    whole inputs), whole size."""
    tp_weight_grad_bytes: int = 0
    """Bytes of the whole weights whose gradients tensor parallelism sums over its ranks in every backward
    (``per_head`` modules); they do not scale with the tokens."""
    tp_split_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    """Unit name -> the part of its ``saved`` bytes, its ``selective`` bytes and its saved bytes made by ``other``
    operators that the tensor-parallel plan splits: each column-wise layer's output and what operators make of it,
    up to the row-wise or gathering layer whose output is whole."""
    tp_gathering_units: list[str] = field(default_factory=list)
    """Units holding layers of a gathering tp style (``recorder.GATHERING_STYLES``), whose activations split as
    ``tp_split_bytes`` measures rather than as Megatron's analysis has a block's."""
    tp_whole_ops: dict[str, list[Op]] = field(default_factory=dict)
    """Unit name -> for the ``tp_gathering_units``, the forward operators every tp rank runs whole: outside the
    layers a tp style splits, on whole activations (attention between a gathered qkv and a row-wise output)."""
    loss_grad_bytes: int = 0
    """The most bytes the loss's backward added to what was saved, before the logits' gradient was complete: the
    gradients of the loss's own tensors and the logits' gradient, less what it saved and has freed by then."""
    document_mask_bytes: int = 0
    """Bytes of the attention mask within packed documents (``disttrain.models.documents``): one per forward,
    which the first block to attend saved and the model keeps whatever the blocks' checkpointing (0: windows are
    not packed)."""
    frozen: dict[str, float] = field(default_factory=dict)
    """Frozen parameter name -> bytes a rank holds per element of it (a LoRA run's base weights, at
    ``model.lora.base_dtype``): its dtype's size, or for a layer held quantised (QLoRA's nf4 base) its codes and
    the blocks' absmax over the weights they hold, a fraction (``NF4Linear.held_bytes``); no gradient, no
    optimiser state."""

    param_rows: dict[str, int] = field(default_factory=dict)
    """Parameter name -> its first dimension, along which FSDP2 shards it (padded to a multiple of the shard
    ranks: every rank holds as many rows, and a gathered unit has that many rows per rank)."""
    tp_rows_split: frozenset[str] = frozenset()
    """Parameters whose first dimension (rows) the tensor-parallel plan splits (column-wise layers' weights and
    biases, experts): FSDP2 pads a tp rank's share of the rows, not the whole's."""
    loss_left_bytes: int | None = None
    """What the loss's backward leaves beside what forward saved once the logits' gradient is complete, as the
    head's backward starts: that gradient, less what the loss saved and has freed by then (None: not measured)."""
    dequantised_bytes: dict[str, int] = field(default_factory=dict)
    """Unit name (or ``ROOT``) -> bytes of the largest weight a layer held quantised inside it (QLoRA's nf4 base)
    dequantises for each of its matrix products, alive while that product runs, in forward and backward
    (``NF4Linear.dequantised_bytes``); empty: the model holds no layer quantised."""

    @functools.cached_property
    def recomputed_ops(self) -> dict[str, list[Op]]:
        """Unit name -> the forward operators selective checkpointing runs again in backward (all but
        ``ops.SELECTIVE_SAVE_OPS``)."""
        return {unit: [op for op in ops if op[3] == "other"] for unit, ops in self.forward_ops.items()}

    @functools.cached_property
    def recomputed_mixture_ops(self) -> dict[str, list[Op]]:
        """Unit name -> the part of ``recomputed_ops`` that runs inside mixtures of experts."""
        return {unit: [op for op in ops if op[3] == "other"] for unit, ops in self.mixture_ops.items()}

    @functools.cached_property
    def tp_unsplit_ops(self) -> dict[str, list[Op]]:
        """Unit name -> the forward operators every tp rank runs whole: ``tp_whole_ops`` in a gathering unit,
        else those of its mixtures of experts (Megatron's split of a block's work holds for the rest)."""
        return {unit: self.tp_whole_ops.get(unit, ops) for unit, ops in self.mixture_ops.items()}

    @functools.cached_property
    def recomputed_tp_unsplit_ops(self) -> dict[str, list[Op]]:
        """Unit name -> the part of ``recomputed_ops`` among ``tp_unsplit_ops``."""
        return {unit: [op for op in ops if op[3] == "other"] for unit, ops in self.tp_unsplit_ops.items()}

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
                  shard_units: list[str] | None = None, tp_plan: dict[str, str] | None = None,
                  autocast: str | None = None) -> ModelStats:
    """One forward and backward of ``net`` (on the meta device; a model on the CPU, or one whose adapted base a
    rank quantises, QLoRA's, is copied there first and quantised as a rank holds it, and is left unchanged) on a
    micro-batch of ``micro_size``, recorded as ``ModelStats``; ``autocast``: the device
    (``cuda`` or ``cpu``) whose bf16 autocast forward and the loss run under, as a ``bf16-mixed`` step runs them
    (None: fp32)."""
    if any(p.device.type != "meta" for p in net.parameters()) or getattr(net, QUANTISE_BASE, None) is not None:
        net = _meta_copy(net)
    # QLoRA's base as a rank holds and runs it (its 4-bit layers, which save nothing for backward but their codes)
    quantise_adapted_bases(net)
    quantised = {f"{name}.weight": layer for name, layer in nf4_layers(net)}
    pipeline_units, shard_units = list(pipeline_units or []), list(shard_units or [])
    units = pipeline_units + [u for u in shard_units if u not in pipeline_units]
    param_numel, param_unit = _parameters(net, units, quantised)
    recorder = PassRecorder(net, units, tp_plan or {})
    inputs, targets = example_batch(spec, micro_size, "meta")
    skip = {inputs.untyped_storage()._cdata, targets.untyped_storage()._cdata}
    skip |= {p.untyped_storage()._cdata for p in net.parameters()}
    # every pass starts without gradients, as a step after zero_grad does: a gradient left by an earlier pass
    # on the same net would add an accumulating operator per parameter to this pass's backward
    kept = {p: p.grad for p in net.parameters()}
    net.zero_grad(set_to_none=True)
    casting = MetaAutocast(autocast) if autocast else None
    recorder.copies = casting.copies if casting else {}
    # what is saved stays counted until backward frees it, so the loss's backward is measured net of what it frees
    live, loss_grad, loss_left = LiveStorages(meta=True), [0], [0]
    recorder.on_saved = live.count
    try:
        # the counter sees each operator before routing's stand-ins for the meta device answer it
        routing = BalancedRouting() if expert_parameters(net) else contextlib.nullcontext()
        with recorder, WholeSequences(), FusedAttention(), routing, \
                OpCounter(FLOP_REGISTRY, recorder.on_op, recorder.on_call), \
                torch.autograd.graph.saved_tensors_hooks(recorder.pack(skip), lambda t: t):
            # autocast's mode comes last, so it casts attention's inputs before the fused kernel stands in; it
            # ends with forward, as a step's autocast context does (its cache of weight copies goes then)
            # attention decides its dtype by the device the pass stands for (a CPU attends in fp32 at short
            # sequences), which under autocast is autocast's
            with casting or contextlib.nullcontext(), meta_tensors_stand_for(autocast or "meta"):
                logits = net(inputs)
                loss = cross_entropy(logits, targets)
            recorder.done_forward()
            # the loss's backward makes its gradients beside everything saved, and frees what it saved itself,
            # before the head's backward starts
            live.peak = start = live.live

            def loss_done(_: torch.Tensor) -> None:
                loss_grad[0], loss_left[0] = live.peak - start, live.live - start

            logits.register_hook(loss_done)
            with live:
                loss.backward()
    finally:
        for p, grad in kept.items():
            p.grad = grad
    tokens = spec.block_size if spec.kind == "text" else 1
    sharded = tp_sharded_parameters(net, tp_plan or {}, param_numel)
    return ModelStats(micro_size, tokens, param_numel, param_unit, units, pipeline_units, shard_units,
                      recorder.saved, recorder.inputs, recorder.outputs, recorder.forward_ops,
                      recorder.backward_ops, nbytes(logits), recorder.tp_forward, recorder.tp_backward, sharded,
                      recorder.saved_by_kind, recorder.selective, recorder.attention_kv, recorder.largest,
                      expert_parameters(net), recorder.expert_calls, recorder.mixture, recorder.mixture_ops,
                      autocast, recorder.weight_copies, recorder.tp_forward_gather, recorder.tp_backward_gather,
                      recorder.tp_weight_grads, recorder.tp_split, sorted(recorder.tp_gathering_units),
                      {u: recorder.tp_whole_ops[u] for u in recorder.tp_gathering_units}, loss_grad[0],
                      _document_mask_bytes(net),
                      _frozen_bytes(net, param_numel, quantised), _rows(net, param_numel, quantised),
                      tp_row_split_parameters(net, tp_plan or {}, param_numel), loss_left[0],
                      _dequantised_bytes(quantised, param_unit))


def _frozen_bytes(net: nn.Module, param_numel: dict[str, int], quantised: dict[str, NF4Linear]) -> dict[str, float]:
    """``ModelStats.frozen`` of ``net``: each frozen parameter's element size, a quantised layer's held bytes per
    weight."""
    return {name: quantised[name].held_bytes() / quantised[name].weights if name in quantised else p.element_size()
            for name, p in net.named_parameters() if name in param_numel and not p.requires_grad}


def _rows(net: nn.Module, param_numel: dict[str, int], quantised: dict[str, NF4Linear]) -> dict[str, int]:
    """``ModelStats.param_rows`` of ``net``: each parameter's first dimension (a quantised layer's output width,
    not its codes')."""
    return {name: quantised[name].out_features if name in quantised else p.shape[0] if p.dim() else 1
            for name, p in net.named_parameters() if name in param_numel}


def _dequantised_bytes(quantised: dict[str, NF4Linear], param_unit: dict[str, str]) -> dict[str, int]:
    """``ModelStats.dequantised_bytes``: per unit, its largest quantised layer's dequantised weight."""
    largest: dict[str, int] = {}
    for name, layer in quantised.items():
        unit = param_unit[name]
        largest[unit] = max(largest.get(unit, 0), layer.dequantised_bytes())
    return largest


def _document_mask_bytes(net: nn.Module) -> int:
    """Bytes of the mask within packed documents the pass built (0: the model packs none)."""
    documents = documents_of(net)
    return 0 if documents is None else documents.mask_bytes()


SHARDING_STYLES = {"colwise": "all", "colwise_gather": "all", "rowwise": "weight", "rowwise_whole_input": "weight",
                   "experts": "all"}
"""Tensor-parallel styles that split a module's own parameters over the tp ranks, and which: ``all`` (column-wise
layers split weight and bias; the ``experts`` style splits every ``[n_experts, ...]`` parameter by whole experts)
or the ``weight`` alone (row-wise layers replicate the bias). ``per_head`` and ``mla_kv_a`` modules, and every
module the plan does not name, are whole on every rank."""


def tp_sharded_parameters(net: nn.Module, tp_plan: dict[str, str], names: dict[str, int]) -> dict[str, bool]:
    """Parameter name (of ``names``) -> whether the tensor-parallel plan splits it, each pattern matched part by
    dotted part as the runtime matches it (``disttrain.parallel.model_plan.matching_modules``)."""
    return {name: which is not None for name, which in _tp_split_parts(net, tp_plan, names).items()}


def tp_row_split_parameters(net: nn.Module, tp_plan: dict[str, str], names: dict[str, int]) -> frozenset[str]:
    """The parameters of ``names`` whose rows the tensor-parallel plan splits (``SHARDING_STYLES`` ``all``: the
    rest it splits, row-wise layers' weights, it splits by columns)."""
    return frozenset(name for name, which in _tp_split_parts(net, tp_plan, names).items() if which == "all")


def _tp_split_parts(net: nn.Module, tp_plan: dict[str, str], names: dict[str, int]) -> dict[str, str | None]:
    """Parameter name -> which part of its module the tensor-parallel plan splits (``SHARDING_STYLES``'s values;
    None: none of it)."""
    from disttrain.parallel.model_plan import matching_modules

    split: dict[str, str] = {}
    for pattern, style in tp_plan.items():
        if style in SHARDING_STYLES:
            split.update(dict.fromkeys(matching_modules(net, pattern), SHARDING_STYLES[style]))

    def sharded(name: str) -> str | None:
        module, _, own = name.rpartition(".")
        which = split.get(module)
        return which if which == "all" or (which == "weight" and own == "weight") else None

    return {name: sharded(name) for name in names}


def _meta_copy(net: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(net).to("meta")


def _parameters(net: nn.Module, units: list[str], quantised: dict[str, NF4Linear]
                ) -> tuple[dict[str, int], dict[str, str]]:
    """Parameter name -> element count (a quantised layer's codes: the weights they hold), and -> its unit."""
    numel, owner, seen = {}, {}, set()
    for name, param in net.named_parameters():  # named_parameters yields a tied parameter once
        if id(param) in seen:
            continue
        seen.add(id(param))
        numel[name] = quantised[name].weights if name in quantised else param.numel()
        inside = [u for u in units if name.startswith(u + ".")]
        owner[name] = max(inside, key=len) if inside else ROOT
    return numel, owner
