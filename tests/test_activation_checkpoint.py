"""Activation checkpointing policies: none, full and selective keep losses and gradients, keep less in that
order, apply to every n-th block, refuse bad values, and train under a pipeline as one process does.

ZeRO-3 with each policy through the runner: ``tests/test_zero_run.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from disttrain.config import validate
from disttrain.errors import ConfigError
from disttrain.launch.job import train
from disttrain.models.gpt import GPT, GPTDims
from disttrain.models.llama import Llama, LlamaDims
from disttrain.parallel.activation_checkpoint import (
    ATTENTION_OPS,
    SAVED_OPS,
    apply_activation_checkpointing,
    checkpoint_policy,
    is_checkpointed,
)
from disttrain.parallel.apply import apply_parallelism
from disttrain.parallel.config import ParallelConfig
from disttrain.parallel.dims import ParallelDims
from disttrain.parallel.layout import Layout
from disttrain.parallel.model_plan import pipeline_units_of
from disttrain.parallel.pipeline.runtime import checkpoint_stage_blocks
from disttrain.parallel.pipeline.split import build_stage_module
from tests.conftest import single_process_curve
from tests.test_pipeline_run import PIPE_MODEL
from tests.test_run import GPT_FAST, step_losses
from tests.test_tp_run import assert_close_curves

GPT_DIMS = GPTDims(n_layer=4, n_head=4, n_embd=64, block_size=128, vocab_size=64)
LLAMA_DIMS = LlamaDims(n_layer=4, n_head=4, n_kv_head=2, n_embd=64, block_size=128, vocab_size=64, mlp_hidden=160)
BATCH = 4
TOLERANCE = 1e-6


def make_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPT_DIMS, dropout=0.0)


def make_llama() -> Llama:
    torch.manual_seed(0)
    return Llama(LLAMA_DIMS, dropout=0.0)


MODELS = {"gpt": make_gpt, "llama": make_llama}


def blocks_of(model: nn.Module) -> nn.ModuleList:
    return model.blocks if isinstance(model, GPT) else model.layers


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (BATCH, 129), generator=torch.Generator().manual_seed(seed))


def loss_and_grads(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x = tokens()
    logits = model(x[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def bytes_kept_by_forward(model: nn.Module, inputs: torch.Tensor) -> int:
    """Bytes the forward of ``inputs`` leaves allocated for backward: the CPU allocator's live bytes at the end of
    the forward minus before it, less the logits it returns.

    torch keeps no statistics of its CPU allocator, so this adds up what its profiler records with
    ``profile_memory=True``: every allocation and free of the pass, each attributed to the operator it happened
    in (or to a ``[memory]`` event outside any operator, where Python dropped an intermediate), each counted once
    as some event's own (``self``) memory. What is still allocated when the forward returns is what the graph
    holds: saved tensors, the inputs a checkpointed block recomputes from and the outputs selective checkpointing
    caches for its recomputation. Counting saved tensors through ``saved_tensors_hooks`` would miss the inside of a
    checkpointed block, where non-reentrant checkpointing installs hooks of its own, and the selective cache.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logits = model(inputs)
    live = sum(event.self_cpu_memory_usage for event in prof.events())
    return live - logits.numel() * logits.element_size()


@pytest.mark.parametrize("every_n_blocks", [1, 2])
@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("name", list(MODELS))
def test_policies_keep_the_loss_gradients_and_names(name, policy, every_n_blocks):
    plain = MODELS[name]()
    checkpointed = apply_activation_checkpointing(MODELS[name](), policy=policy, every_n_blocks=every_n_blocks)
    chosen = [policy if (i + 1) % every_n_blocks == 0 else "none" for i in range(4)]
    assert [checkpoint_policy(block) for block in blocks_of(checkpointed)] == chosen
    assert [n for n, _ in plain.named_parameters()] == [n for n, _ in checkpointed.named_parameters()]
    loss, grads = loss_and_grads(plain)
    loss_ckpt, grads_ckpt = loss_and_grads(checkpointed)
    torch.testing.assert_close(loss_ckpt, loss, rtol=0, atol=TOLERANCE)
    for key, grad in grads.items():
        torch.testing.assert_close(grads_ckpt[key], grad, rtol=0, atol=TOLERANCE, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.parametrize("name", list(MODELS))
def test_selective_keeps_less_than_none_and_more_than_full(name):
    kept = {}
    for policy in ("none", "full", "selective"):
        for every_n_blocks in (1, 2):
            model = apply_activation_checkpointing(MODELS[name](), policy=policy, every_n_blocks=every_n_blocks)
            kept[policy, every_n_blocks] = bytes_kept_by_forward(model, tokens()[:, :-1])
    none = kept["none", 1]
    assert none > kept["selective", 1] > kept["full", 1], kept
    for policy in ("full", "selective"):  # half the blocks checkpointed: between all of them and none
        assert kept[policy, 1] < kept[policy, 2] < none, (policy, kept)


class RecordOps(TorchDispatchMode):
    """Every operator that reaches the dispatcher (after composite operators decompose)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket)
        return func(*args, **(kwargs or {}))


def test_the_selective_policy_names_what_cpu_attention_and_linear_layers_dispatch_to():
    q = torch.randn(2, 4, 16, 8, requires_grad=True)
    masks = {"causal": {"is_causal": True}, "bool mask": {"attn_mask": torch.ones(16, 16, dtype=torch.bool).tril()},
             "float mask": {"attn_mask": torch.zeros(16, 16)}}
    for what, kwargs in masks.items():
        with RecordOps() as recorded:
            F.scaled_dot_product_attention(q, q, q, **kwargs)
        assert set(recorded.ops) & ATTENTION_OPS, (what, recorded.ops)
    for bias in (True, False):
        with RecordOps() as recorded:
            nn.Linear(8, 8, bias=bias)(q)
        assert set(recorded.ops) & SAVED_OPS, (bias, recorded.ops)


def test_applying_twice_keeps_the_first_policy_and_none_changes_nothing():
    model = apply_activation_checkpointing(make_gpt(), policy="selective")
    assert apply_activation_checkpointing(model, policy="full") is model
    assert all(checkpoint_policy(block) == "selective" for block in model.blocks)
    assert not any(is_checkpointed(block) for block in apply_activation_checkpointing(make_gpt(), policy="none").blocks)


def test_the_run_applies_the_configured_policy_to_every_nth_block():
    parallel = ParallelConfig(activation_checkpoint="selective", checkpoint_every_n_blocks=3)
    model = apply_parallelism(make_gpt(), None, Layout.of(parallel, ParallelDims()), torch.device("cpu"))
    assert [checkpoint_policy(block) for block in model.blocks] == ["none", "none", "selective", "none"]
    assert not any(is_checkpointed(block) for block in
                   apply_parallelism(make_gpt(), None, Layout.of(ParallelConfig(), ParallelDims()),
                                     torch.device("cpu")).blocks)


def test_pipeline_stages_checkpoint_their_blocks_counted_over_the_whole_model():
    model = make_gpt()
    units = pipeline_units_of(model)  # embed, blocks.0-3, ln_f, lm_head
    stages = [build_stage_module(model, units, i, [0, 3]) for i in range(2)]  # blocks 0, 1 | blocks 2, 3
    parallel = ParallelConfig(activation_checkpoint="full", checkpoint_every_n_blocks=2)
    checkpoint_stage_blocks(model, stages[1:], Layout.of(parallel, ParallelDims()), parallel)  # the second stage's rank
    assert [checkpoint_policy(block) for block in model.blocks] == ["none", "none", "none", "full"]
    checkpoint_stage_blocks(model, stages[:1], Layout.of(parallel, ParallelDims()), parallel)
    assert [checkpoint_policy(block) for block in model.blocks] == ["none", "full", "none", "full"]


@pytest.mark.parametrize(
    ("overrides", "key", "allowed"),
    [
        (["parallel.activation_checkpoint=true"], "parallel.activation_checkpoint", "one of none, full, selective"),
        (["parallel.activation_checkpoint=ops"], "parallel.activation_checkpoint", "one of none, full, selective"),
        (["parallel.checkpoint_every_n_blocks=0"], "parallel.checkpoint_every_n_blocks", "a positive number"),
        (["parallel=pipeline", "trainer.devices=2", *GPT_FAST, *PIPE_MODEL, "parallel.pipeline.schedule=zbv",
          "parallel.pipeline.stages_per_rank=2", "parallel.activation_checkpoint=selective"],
         "parallel.activation_checkpoint", "none or full with the zbv schedule"),
        (["model=custom", "model._target_=torch.nn.Flatten", "parallel.activation_checkpoint=full"],
         "parallel.activation_checkpoint", "no blocks to checkpoint"),
    ],
)
def test_bad_checkpointing_is_one_clear_line(make_config, overrides, key, allowed):
    with pytest.raises(ConfigError) as info:
        validate(make_config(overrides))
    message = str(info.value)
    assert "\n" not in message and info.value.key == key, message
    assert allowed in message, message


@pytest.fixture(scope="module")
def pipeline_single_curve(tmp_path_factory):
    return single_process_curve(tmp_path_factory, [*GPT_FAST, *PIPE_MODEL])


@pytest.mark.parametrize(("schedule", "policy"), [("1f1b", "selective"), ("zero_bubble", "full")])
def test_checkpointed_pipeline_stages_match_one_process(make_config, tmp_path, pipeline_single_curve, schedule,
                                                         policy):
    stages = 2 if schedule == "zero_bubble" else 1
    overrides = [*GPT_FAST, *PIPE_MODEL, "parallel=pipeline", "trainer.devices=2",
                 f"parallel.pipeline.schedule={schedule}", f"parallel.pipeline.stages_per_rank={stages}",
                 f"parallel.activation_checkpoint={policy}"]
    train(make_config(overrides, tmp_path / "run"))
    assert_close_curves(pipeline_single_curve, step_losses(tmp_path / "run"))
