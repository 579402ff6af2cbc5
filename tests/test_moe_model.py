"""The mixture-of-experts model (``model=moe``) against references written out here, one token at a time.

The layer (``disttrain.models.experts.MoEFeedForward``) is compared with a per-token loop: each token's output is
the sum over its chosen experts of its renormalised score times that expert's SwiGLU, plus the shared expert.
Choices are made in Python from the scores (plus the balancing bias) and drops from a running count per sequence,
so none of them reuses the module's own tensor code. The load balancing (balance loss, routing bias):
``test_moe_balance.py``; the model's configuration, sizes and Hugging Face mixtures: ``test_moe_config.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from disttrain.data.spec import DataSpec
from disttrain.models import experts as experts_module
from disttrain.models.experts import MoEFeedForward
from disttrain.models.llama import FeedForward

# fp32 on a CPU: the layer and the per-token loop (or the grouped kernel and the per-expert products, or a model and
# its copy) differ by summation order only, measured up to 5.7e-7 of a tensor's largest magnitude; a wrong weight,
# choice, drop or scale moves them by 1e-3 of it or more
TOL = 2e-6
SPEC = DataSpec("text", vocab_size=64, block_size=32)


def make_layer(n_embd: int = 32, n_experts: int = 4, top_k: int = 2, hidden: int = 16, shared: bool = False,
               seed: int = 0, **options) -> MoEFeedForward:
    """A layer with weights large enough that routing and the experts' outputs differ visibly between tokens."""
    torch.manual_seed(seed)
    layer = MoEFeedForward(n_embd, n_experts, top_k, hidden, FeedForward(n_embd, hidden, 0.0) if shared else None,
                           **options)
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 0.5)
        for weight in (layer.experts.w1, layer.experts.w3, layer.experts.w2):
            weight.normal_(0.0, 0.3)
        if shared:
            for linear in (layer.shared.w1, layer.shared.w3, layer.shared.w2):
                linear.weight.normal_(0.0, 0.3)
    return layer


def chosen_experts(layer: MoEFeedForward, x: torch.Tensor) -> list[list[list[int]]]:
    """``[B][T]``: each token's ``top_k`` experts, largest score (plus bias, when balancing) first, chosen in
    Python."""
    with torch.no_grad():
        scores = torch.softmax(x @ layer.router.weight.T, dim=-1)
        if layer.bias_update_rate:
            scores = scores + layer.expert_bias
    return [[sorted(range(layer.n_experts), key=lambda e: -row[e])[:layer.top_k] for row in sequence]
            for sequence in scores.tolist()]


def capacity_drops(choices: list[list[list[int]]], n_experts: int, capacity: int) -> set[tuple[int, int, int]]:
    """``(sequence, position, expert)`` of the assignments beyond the first ``capacity`` of each expert in each
    sequence, counted from the sequence's start."""
    dropped = set()
    for b, sequence in enumerate(choices):
        taken = [0] * n_experts
        for t, token_experts in enumerate(sequence):
            for e in token_experts:
                if taken[e] >= capacity:
                    dropped.add((b, t, e))
                taken[e] += 1
    return dropped


def reference_output(layer: MoEFeedForward, x: torch.Tensor,
                     dropped: set[tuple[int, int, int]] = frozenset()) -> torch.Tensor:
    """The layer's output computed token by token: each chosen (and not dropped) expert's SwiGLU weighted by its
    unbiased score over the sum of the chosen experts' scores, plus the shared expert."""
    choices = chosen_experts(layer, x)
    w1, w3, w2 = layer.experts.w1, layer.experts.w3, layer.experts.w2
    rows = []
    for b in range(x.size(0)):
        for t in range(x.size(1)):
            token = x[b, t]
            scores = torch.softmax(layer.router.weight @ token, dim=-1)
            chosen = choices[b][t]
            total = sum(scores[e] for e in chosen)
            out = torch.zeros_like(token)
            for e in chosen:
                if (b, t, e) not in dropped:
                    out = out + scores[e] / total * ((F.silu(token @ w1[e]) * (token @ w3[e])) @ w2[e])
            if layer.shared is not None:
                out = out + layer.shared(token)
            rows.append(out)
    return torch.stack(rows).view_as(x)


def output_and_grads(layer: MoEFeedForward, x: torch.Tensor, probe: torch.Tensor, compute) -> list[torch.Tensor]:
    """``compute(layer, x)`` and the gradients of ``sum(output * probe)`` for the input and every parameter."""
    x = x.detach().requires_grad_(True)
    out = compute(layer, x)
    params = [p for _, p in sorted(layer.named_parameters())]
    return [out.detach(), *torch.autograd.grad((out * probe).sum(), [x, *params])]


def assert_all_close(got: list[torch.Tensor], expected: list[torch.Tensor], tol: float = TOL,
                     names: list[str] | None = None) -> None:
    """Each tensor within ``tol`` of the largest magnitude of its expected one (fp32 summed in another order);
    unnamed, they are the output, the input's gradient, then the parameters' by name."""
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        name = names[i] if names else i
        assert a.shape == b.shape, (name, a.shape, b.shape)
        deviation = ((a - b).abs().max() / b.abs().max()).item()
        assert deviation <= tol, f"tensor {name}: deviation {deviation:.2e} of its scale > {tol}"


def grouped_kernel_calls(monkeypatch) -> list[int]:
    """Counts the calls of ``torch._grouped_mm`` made through the experts' module from now on."""
    calls = []
    real = torch._grouped_mm

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(experts_module.torch, "_grouped_mm", counted)
    return calls


# --- output and gradients against the per-token loop ---------------------------------------------------------


@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared"])
@pytest.mark.parametrize("n_embd", [32, 30], ids=["grouped-kernel", "per-expert"])
def test_layer_equals_the_per_token_loop(monkeypatch, shared, n_embd):
    """Output and the gradients of input, router, experts and shared expert; width 32 runs the grouped kernel,
    width 30 (rows of 120 bytes, not 16-byte multiples) the per-expert products."""
    calls = grouped_kernel_calls(monkeypatch)
    layer = make_layer(n_embd=n_embd, shared=shared)
    x = torch.randn(2, 8, n_embd)
    probe = torch.randn(2, 8, n_embd)
    got = output_and_grads(layer, x, probe, lambda m, inp: m(inp))
    assert bool(calls) == (n_embd == 32)
    expected = output_and_grads(layer, x, probe, reference_output)
    assert_all_close(got, expected)
    assert all(g.abs().max() > 1e-3 for g in got[1:])  # every parameter takes part


def test_bias_changes_the_choice_but_not_the_weights():
    """A balancing bias that favours expert 3 sends it tokens it would not get, weighted by unbiased scores."""
    layer = make_layer(bias_update_rate=0.01)
    x = torch.randn(2, 8, 32)
    unbiased = chosen_experts(layer, x)
    layer.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 1.0]))
    biased = chosen_experts(layer, x)
    assert sum(3 in token for sequence in biased for token in sequence) == 16
    assert sum(3 in token for sequence in unbiased for token in sequence) < 16
    probe = torch.randn(2, 8, 32)
    expected = output_and_grads(layer, x, probe, reference_output)
    assert_all_close(output_and_grads(layer, x, probe, lambda m, inp: m(inp)), expected)
    routing, scores = layer.route(x)
    chosen_scores = scores.gather(-1, routing.experts)
    torch.testing.assert_close(routing.weights, chosen_scores / chosen_scores.sum(-1, keepdim=True))
    # with the rate at 0 the bias is not used: the choice is the scores' own
    layer.bias_update_rate = 0.0
    assert [[sorted(t) for t in s] for s in layer.route(x)[0].experts.tolist()] == \
        [[sorted(t) for t in s] for s in unbiased]


# --- grouped kernel and per-expert loop ------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [None, [1.0, 1.0, 0.0, 0.0]], ids=["spread", "two-experts-idle"])
def test_grouped_kernel_and_per_expert_products_agree(monkeypatch, bias):
    """The same layer through ``torch._grouped_mm`` and through one product per expert (the path unaligned
    widths take): equal outputs and gradients, also with experts that receive no rows."""
    layer = make_layer(shared=True, bias_update_rate=0.01 if bias else 0.0)
    if bias:
        layer.expert_bias.copy_(torch.tensor(bias))
    x, probe = torch.randn(3, 8, 32), torch.randn(3, 8, 32)
    calls = grouped_kernel_calls(monkeypatch)
    grouped = output_and_grads(layer, x, probe, lambda m, inp: m(inp))
    assert len(calls) == 3  # w1, w3, w2
    monkeypatch.setattr(experts_module, "_grouped_mm_aligned", lambda rows, weight: False)
    calls.clear()
    looped = output_and_grads(layer, x, probe, lambda m, inp: m(inp))
    assert not calls
    if bias:
        assert set(layer.route(x)[0].experts.unique().tolist()) == {0, 1}
    assert_all_close(looped, grouped)


# --- capacity --------------------------------------------------------------------------------------------------


def leaning_layer(capacity_factor: float) -> tuple[MoEFeedForward, torch.Tensor]:
    """A layer whose router leans towards expert 0, and 4 sequences of 12 tokens along the lean, so that expert 0
    is in most tokens' top 2 and capacity binds."""
    layer = make_layer(capacity_factor=capacity_factor)
    lean = torch.ones(32) / math.sqrt(32)
    with torch.no_grad():
        layer.router.weight[0] += 2.0 * lean
    return layer, torch.randn(4, 12, 32, generator=torch.Generator().manual_seed(1)) + 0.5 * lean * math.sqrt(32)


def test_capacity_keeps_the_earliest_assignments_of_each_expert_in_each_sequence():
    """Factor 0.9 on 12 tokens, top 2 of 4: each expert keeps ceil(5.4) = 6 assignments of each sequence, the
    earliest; the rest contribute nothing, and the kept keep their weights."""
    layer, x = leaning_layer(0.9)
    choices = chosen_experts(layer, x)
    dropped = capacity_drops(choices, 4, capacity=6)
    assert len(dropped) >= 8
    assert capacity_drops(choices, 4, capacity=5) != dropped  # a floor instead of a ceiling would drop more

    routing, _ = layer.route(x)
    expected_kept = [[[(b, t, e) not in dropped for e in routing.experts[b, t].tolist()] for t in range(12)]
                     for b in range(4)]
    assert routing.kept.tolist() == expected_kept
    kept_per_expert = torch.zeros(4, 4, dtype=torch.long).index_put_(
        (torch.arange(4).view(4, 1, 1).expand_as(routing.experts)[routing.kept], routing.experts[routing.kept]),
        torch.tensor(1), accumulate=True)
    load_per_expert = F.one_hot(routing.experts, 4).sum((1, 2))
    assert torch.equal(kept_per_expert, load_per_expert.clamp(max=6))

    probe = torch.randn_like(x)
    expected = output_and_grads(layer, x, probe, lambda m, inp: reference_output(m, inp, dropped))
    layer.train()
    got = output_and_grads(layer, x, probe, lambda m, inp: m(inp))
    assert_all_close(got, expected)
    load, drops, aux = layer.take_step_statistics()
    assert torch.equal(load, load_per_expert.sum(0))
    assert drops.item() == len(dropped)
    assert aux is None  # no balance loss asked for
    assert layer.take_step_statistics() == (None, None, None)


def test_capacity_is_per_sequence_whatever_the_split_of_the_batch():
    """The same tokens are dropped, and the same outputs come, when the batch runs whole or in halves; the step's
    statistics add up over the forwards."""
    layer, x = leaning_layer(1.0)
    whole_kept = layer.route(x)[0].kept
    halves_kept = torch.cat([layer.route(x[:2])[0].kept, layer.route(x[2:])[0].kept])
    assert torch.equal(whole_kept, halves_kept)
    assert 0 < (~whole_kept[:2]).sum() and 0 < (~whole_kept[2:]).sum()
    whole = layer(x)
    whole_stats = layer.take_step_statistics()
    halves = torch.cat([layer(x[:2]), layer(x[2:])])
    halves_stats = layer.take_step_statistics()
    assert_all_close([halves], [whole])
    assert torch.equal(whole_stats[0], halves_stats[0]) and whole_stats[1].item() == halves_stats[1].item()
    assert whole_stats[1].item() == (~whole_kept).sum().item()
