"""Megatron-style tensor parallelism for the GPT (``torch.distributed.tensor.parallel``), optional sequence
parallelism.

Per block, ``attn.{q,k,v}`` and ``mlp.fc`` are column-sharded and ``attn.proj`` and ``mlp.proj`` row-sharded
over the tp mesh, so each rank holds ``n_head / tp`` heads and ``4 n_embd / tp`` MLP columns; one all-reduce
per sub-layer (forward and backward) joins the partial outputs. Attention takes its head count from the
width of the sharded projections.

The embeddings (``wte``, ``wpe``), the final norm and the LM head stay replicated: every tp rank looks up and
projects the full vocabulary. This keeps the LM head tied to the token embedding (one parameter, exactly as
without tp) at the cost of not sharding the vocabulary. Their gradients are complete and equal on all tp
ranks, because the sharded layers all-reduce the gradient flowing back into the replicated activations.

With ``sequence_parallel`` the residual stream between the sharded layers is split along the sequence
(dim 1): LayerNorms run on the local tokens (``SequenceParallel``), attention and MLP all-gather their input
and the row-sharded projections reduce-scatter their output; the embedding output is split after dropout
and the final norm's output gathered before the LM head.

All tp ranks must see the same batch. Dropout masks are drawn per rank; for exact replication keep
dropout at 0 or seed the tp ranks alike.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from disttrain.errors import ConfigError

_TOP = ("wte", "wpe", "drop", "blocks", "ln_f", "lm_head")
_BLOCK = ("ln_1", "attn.q", "attn.k", "attn.v", "attn.proj", "ln_2", "mlp.fc", "mlp.proj")


def tp_plan_available(model: nn.Module) -> bool:
    """Whether ``model`` has the GPT layout that ``apply_tp`` shards (``wte, ..., blocks.<i>.attn.q, ...``)."""
    if not all(hasattr(model, name) for name in _TOP) or not isinstance(model.blocks, nn.ModuleList):
        return False
    names = {name for name, _ in model.named_modules()}
    return len(model.blocks) > 0 and all(f"blocks.{i}.{sub}" in names
                                         for i in range(len(model.blocks)) for sub in _BLOCK)


def check_tp_divisibility(n_head: int, n_embd: int, tp: int) -> None:
    """ConfigError unless ``tp`` divides the attention heads and the MLP width ``4 n_embd``."""
    if n_head % tp:
        raise ConfigError("model.n_head", n_head, f"divisible by parallel.tp={tp}")
    if 4 * n_embd % tp:
        raise ConfigError("model.n_embd", n_embd, f"an MLP width 4*n_embd={4 * n_embd} divisible by parallel.tp={tp}")


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> nn.Module:
    """Shard ``model`` (a GPT) in place over the 1-D ``tp_mesh`` and return it; build the optimiser after."""
    if not tp_plan_available(model):
        raise ValueError(f"model {type(model).__name__} has no tensor-parallel plan; tp needs a model with "
                         "wte, wpe, drop, blocks.<i>.{ln_1, attn.{q,k,v,proj}, ln_2, mlp.{fc,proj}}, ln_f and "
                         "lm_head (gpt)")
    seq = Shard(1)
    plan = block_plan(sequence_parallel)
    if sequence_parallel:
        parallelize_module(model, tp_mesh, {
            "drop": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=seq),
            "ln_f": SequenceParallel(),
            "lm_head": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                          use_local_output=True),
        })
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)
    return model


def block_plan(sequence_parallel: bool = False) -> dict:
    """The tensor-parallel plan of one transformer block (also used on the blocks of a pipeline stage)."""
    seq = Shard(1)
    out = seq if sequence_parallel else Replicate()
    plan = {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(output_layouts=out),
        "mlp.fc": ColwiseParallel(),
        "mlp.proj": RowwiseParallel(output_layouts=out),
    }
    if sequence_parallel:
        gather = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True)
        plan |= {"ln_1": SequenceParallel(), "attn": gather, "ln_2": SequenceParallel(), "mlp": gather}
    return plan
