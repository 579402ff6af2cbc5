"""The planner's activations under bf16-mixed against what autocast really keeps: its pass runs under autocast's
own lists (``disttrain.plan.autocast``), measured here against CPU autocast on real tensors, and against the
cross-entropy as CUDA composes it; and in fp32 at a vocabulary where the loss's tensors dominate."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from disttrain.config.typed import model_typed
from disttrain.data.spec import DataSpec, example_batch
from disttrain.models import MODELS, build_model
from disttrain.observe.tensor_bytes import LiveStorages
from disttrain.parallel.activation_checkpoint import apply_activation_checkpointing
from disttrain.parallel.config import ParallelConfig
from disttrain.plan.hardware import PROFILES
from disttrain.plan.layout import Layout
from disttrain.plan.measure import measured_activations
from disttrain.plan.planner import plan_inputs

LARGE_VOCAB = 50304
"""GPT-2's padded vocabulary: the loss's tensors, [tokens, vocabulary] each, outweigh a small model's blocks."""
GPU = PROFILES["h100_sxm"]
CPU = replace(GPU, name="cpu", cpu=True)
"""A CPU profile: a plan for it follows CPU autocast's lists, as the measurement here runs."""
# the CPU attends in fp32 at short sequences (``models.attention``); the pass, on the meta device, takes the GPU's
# branch, so the measured models do too
CASES = [({"name": "gpt", "flavour": "micro", "bias": False}, LARGE_VOCAB, 2),
         ({"name": "gpt", "flavour": "nano"}, LARGE_VOCAB, 2),
         ({"name": "llama", "flavour": "micro"}, LARGE_VOCAB, 2),
         ({"name": "gpt", "flavour": "nano"}, 96, 16),
         ({"name": "llama", "flavour": "micro"}, 96, 16)]


def _case_id(value: object) -> str:
    return value["name"] + value["flavour"] if isinstance(value, dict) else str(value)


def _model(cfg: dict, vocab: int) -> tuple[torch.nn.Module, DataSpec]:
    spec = DataSpec("text", vocab_size=vocab, block_size=64 if cfg["flavour"] == "nano" else 32)
    torch.manual_seed(0)
    return build_model(model_typed(OmegaConf.create({**cfg, "attention_fp32": False}), MODELS), spec), spec


def _planned(net: torch.nn.Module, spec: DataSpec, micro: int, profile, layout: Layout | None = None):
    inputs = plan_inputs(net, spec, micro, ParallelConfig(), OmegaConf.create({"name": "adamw"}), "bf16-mixed",
                         profile)
    return inputs, inputs.estimate(layout or Layout(micro_size=micro))


@pytest.mark.parametrize(("cfg", "vocab", "micro"), CASES, ids=_case_id)
def test_bf16_activations_are_within_15_percent_of_what_cpu_autocast_keeps(cfg: dict, vocab: int, micro: int
                                                                           ) -> None:
    """Measured here (predicted / measured peak): with the vocabulary of 50304, GPT micro, GPT nano and Llama
    micro 1.000 (held when forward ends 1.000 too); with 96, GPT nano 0.999 and Llama micro 1.000. Half of
    the fp32 pass, as the plan took bf16-mixed before, gave 0.31, 0.30 and 0.31, and 0.72 and 0.65: autocast
    keeps the fp32 residual stream, the loss's fp32 log-softmax and a bf16 copy of every weight, and backward
    starts with the loss's fp32 gradients."""
    net, spec = _model(cfg, vocab)
    _, e = _planned(net, spec, micro, CPU)
    held, measured = measured_activations(net, example_batch(spec, micro), autocast=torch.bfloat16)
    predicted = e.memory["activations"]
    assert predicted == pytest.approx(measured, rel=0.15), (predicted, measured)
    assert e.activations_held == pytest.approx(held, rel=0.15), (e.activations_held, held)


@pytest.mark.parametrize(("cfg", "vocab", "micro"), CASES, ids=_case_id)
def test_fp32_activations_count_the_loss_backward_at_any_vocabulary(cfg: dict, vocab: int, micro: int) -> None:
    """Measured here (predicted / measured peak): 1.000 for the three at 50304, 0.981 and 1.000 at 96; with the
    logits' gradient alone as backward's start (the loss's backward also holds the log-probabilities' gradient)
    0.67-0.68 at 50304."""
    net, spec = _model(cfg, vocab)
    inputs = plan_inputs(net, spec, micro, ParallelConfig(), OmegaConf.create({"name": "adamw"}), "32-true", CPU)
    e = inputs.estimate(Layout(micro_size=micro))
    held, measured = measured_activations(net, example_batch(spec, micro))
    assert e.memory["activations"] == pytest.approx(measured, rel=0.15), (e.memory["activations"], measured)
    assert e.activations_held == pytest.approx(held, rel=0.15), (e.activations_held, held)


def _cuda_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy`` as torch composes it where autocast does not list it (CUDA): a log-softmax told to keep
    the logits' dtype, then ``nll_loss``, which CPU autocast runs in fp32 as CUDA's does."""
    flat = logits.reshape(-1, logits.size(-1))
    return F.nll_loss(torch.log_softmax(flat, 1, dtype=flat.dtype), targets.reshape(-1))


@pytest.mark.parametrize(("cfg", "vocab", "micro"), CASES[:3], ids=_case_id)
def test_a_gpu_plan_keeps_what_cudas_cross_entropy_keeps(cfg: dict, vocab: int, micro: int) -> None:
    """A GPU's plan follows CUDA's lists: the cross-entropy keeps a bf16 log-softmax and the fp32 copy
    ``nll_loss`` takes of it (6 bytes per logit), and backward starts with one fp32 gradient (4 more); on the CPU
    4 and 8. Measured (predicted / measured peak) with the loss composed as CUDA runs it: 1.000 for all three;
    the CPU's plan would be 2 bytes per logit over (1.18 for GPT micro)."""
    net, spec = _model(cfg, vocab)
    _, e = _planned(net, spec, micro, GPU)
    _, measured = measured_activations(net, example_batch(spec, micro), torch.bfloat16, _cuda_cross_entropy)
    assert e.memory["activations"] == pytest.approx(measured, rel=0.15), (e.memory["activations"], measured)
    _, on_cpu = _planned(net, spec, micro, CPU)
    logits = micro * spec.block_size * vocab
    assert on_cpu.memory["activations"] - e.memory["activations"] == pytest.approx(2 * logits)


def test_zero3_gathering_bf16_weights_keeps_no_copies_of_them() -> None:
    """Autocast's bf16 copies: one of each weight that a matrix product multiplies (the tied embedding once, as
    the head casts it; not the position embedding, which is looked up, nor the norms, which CUDA runs in fp32),
    whatever the batch. FSDP2 under bf16-mixed on a GPU gathers bf16 weights, so ZeRO-3 there makes none; on a
    CPU it gathers fp32 ones, which autocast casts as without it."""
    net, spec = _model({"name": "gpt", "flavour": "micro", "bias": False}, LARGE_VOCAB)
    inputs, single = _planned(net, spec, 2, GPU)
    multiplied = sum(p.numel() for name, p in net.named_parameters() if p.dim() == 2 and "wpe" not in name)
    assert sum(inputs.stats.weight_copy_bytes.values()) == 2 * multiplied
    zero3 = Layout(zero_stage=3, micro_size=2)
    assert single.memory["activations"] - inputs.estimate(zero3).memory["activations"] == 2 * multiplied
    cpu_inputs, cpu_single = _planned(net, spec, 2, CPU)
    assert cpu_inputs.estimate(zero3).memory["activations"] == cpu_single.memory["activations"]
    # a micro-batch twice as large doubles the activations and not the copies, but for the loss's few scalars
    # (measured 264 bytes of 68 MB)
    _, double = _planned(net, spec, 4, GPU)
    assert double.memory["activations"] == pytest.approx(2 * single.memory["activations"] - 2 * multiplied,
                                                         abs=1024)


def test_an_fp32_plan_is_the_fp32_pass() -> None:
    """32-true plans measure in fp32 without autocast, as before: the pass records no copies and no autocast."""
    net, spec = _model({"name": "gpt", "flavour": "micro", "bias": False}, LARGE_VOCAB)
    stats = plan_inputs(net, spec, 2, ParallelConfig(), None, "32-true", GPU).stats
    assert stats.autocast is None and not any(stats.weight_copy_bytes.values())
    assert stats.output_bytes == 2 * 32 * LARGE_VOCAB * 4


def _step_peak(net: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    """The most bytes alive at once in a training step's forward, loss and backward under CPU autocast, starting
    with no gradients (as a step does once the last one's are freed): activations and gradients together."""
    inputs, targets = batch
    for p in net.parameters():
        p.grad = None
    with LiveStorages() as live:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(net(inputs).flatten(0, 1), targets.flatten())
        loss.backward()
    return live.peak


WIDE_LLAMA = {"name": "llama", "n_layer": 4, "n_embd": 256, "n_head": 8, "n_kv_head": 2, "mlp_hidden": 1024}
"""A Llama whose blocks' gradients weigh as much as what a checkpointed step recomputes of a block."""


def test_a_checkpointed_step_peaks_with_the_gradients_beside_the_first_blocks_backward() -> None:
    """Under full checkpointing the activations are small, and the step's peak comes when backward reaches the
    first block: every other block's gradients exist beside its recomputed activations. Measured here
    (predicted / measured, activations and gradients): 0.88 (a GPT of the same width 0.91); without that moment
    (the larger of the activations' peak and the gradients) 0.65 (0.65). On one H200 a 1.2B Llama under full
    checkpointing: 19.97 GB predicted for 19.79 GB measured."""
    spec = DataSpec("text", vocab_size=96, block_size=256)
    torch.manual_seed(0)
    net = build_model(model_typed(OmegaConf.create({**WIDE_LLAMA, "attention_fp32": False}), MODELS), spec)
    micro = 4
    _, e = _planned(net, spec, micro, CPU, Layout(micro_size=micro, activation_checkpoint="full"))
    apply_activation_checkpointing(net)
    measured = _step_peak(net, example_batch(spec, micro))
    predicted = max(e.phases.values()) - e.memory["params"] - e.memory["optimizer"]
    assert predicted == pytest.approx(measured, rel=0.15), (predicted, measured)
