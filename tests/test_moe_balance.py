"""The mixture-of-experts model's load balancing against references written out here: the sequence-wise balance
loss from its formula, its gradient as that of adding it to the loss by hand, activation checkpointing counting
each forward once, and the routing bias that evens the load (``update_bias``). The layer's and model's outputs,
gradients and capacity: ``test_moe_model.py``."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from disttrain.models.experts import MoEFeedForward, moe_layers
from disttrain.models.moe import MoEConfig, MoETransformer, build_moe
from tests.test_moe_model import SPEC, assert_all_close, chosen_experts, make_layer

# --- balance loss ----------------------------------------------------------------------------------------------


def hand_balance_loss(layer: MoEFeedForward, x: torch.Tensor, coef: float) -> torch.Tensor:
    """``coef * mean over sequences of sum_i f_i P_i``: f_i is expert i's count among the sequence's T x k
    assignments times E / (T k), P_i its mean score over the sequence (differentiable in the scores)."""
    n_experts, top_k = layer.n_experts, layer.top_k
    choices = chosen_experts(layer, x)
    scores = torch.softmax(x @ layer.router.weight.T, dim=-1)
    per_sequence = []
    for b, sequence in enumerate(choices):
        length = len(sequence)
        counts = [sum(e in token for token in sequence) for e in range(n_experts)]
        f = [n_experts * count / (length * top_k) for count in counts]
        p = scores[b].mean(0)
        per_sequence.append(sum(f[i] * p[i] for i in range(n_experts)))
    return coef * torch.stack(per_sequence).mean()


def test_balance_loss_is_the_sequence_wise_formula():
    layer = make_layer(aux_loss_coef=0.1).train()
    with torch.no_grad():
        layer.router.weight[0] += 1.0
    x = torch.randn(3, 10, 32)
    layer(x)
    _, _, aux = layer.take_step_statistics()
    expected = hand_balance_loss(layer, x, 0.1)
    torch.testing.assert_close(aux, torch.stack([expected.detach(), torch.tensor(1.0)]), rtol=1e-6, atol=0)
    assert expected.item() > 0.1 * 1.05  # skewed routing: above the balanced value coef * 1
    layer.eval()
    layer(x)
    assert layer.take_step_statistics() == (None, None, None)  # evaluation records nothing


def tiny_moe(seed: int = 0, **options) -> MoETransformer:
    """A seeded micro model=moe of 2 layers, 4 experts, 2 per token."""
    torch.manual_seed(seed)
    cfg = MoEConfig(flavour="micro", n_layer=2, n_experts=4, top_k=2, **options)
    return build_moe(cfg, SPEC)


def model_gradients(model: MoETransformer, tokens: torch.Tensor, aux_by_hand: tuple[float, float] | None = None
                    ) -> dict[str, torch.Tensor]:
    """Gradients of the next-token cross-entropy, plus ``scale * balance loss`` of every mixture layer computed
    by hand from the layer's input when ``aux_by_hand`` is ``(coef, scale)``."""
    inputs = []
    hooks = [layer.register_forward_pre_hook(lambda m, args: inputs.append((m, args[0])))
             for _, layer in moe_layers(model)]
    model.zero_grad()
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    if aux_by_hand is not None:
        coef, scale = aux_by_hand
        loss = loss + scale * sum(hand_balance_loss(layer, x, coef) for layer, x in inputs)
    loss.backward()
    for hook in hooks:
        hook.remove()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_balance_loss_gradient_is_that_of_adding_it_to_the_loss(scale):
    """The gradient the layers add through ``AuxiliaryLossGradient`` equals that of ``loss + scale * aux``
    written out on a copy without the layers' own balance loss; the scale weighs the aux part only."""
    model = tiny_moe(aux_loss_coef=0.05).train()
    for _, layer in moe_layers(model):
        layer.aux_loss_scale = scale
    by_hand = copy.deepcopy(model)
    for _, layer in moe_layers(by_hand):
        layer.aux_loss_coef = 0.0
    tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(2))
    got = model_gradients(model, tokens)
    expected = model_gradients(by_hand, tokens, aux_by_hand=(0.05, scale))
    without = model_gradients(by_hand, tokens)
    assert_all_close(list(got.values()), [expected[name] for name in got], names=list(got))
    routers = [name for name in got if name.endswith("router.weight")]
    assert len(routers) == 2
    for name in routers:  # the balance loss's share of the router's gradient is far above the tolerance
        assert (got[name] - without[name]).abs().max() > 1e-4 * scale


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_activation_checkpointing_counts_each_forward_once(policy):
    """Recomputing a block in backward neither counts its assignments, drops and balance loss again nor changes
    the gradients (the balance loss's included), over two micro-batches of a step (the second forward adds to
    the step's counts, which its recomputation must not)."""
    from disttrain.parallel.activation_checkpoint import apply_activation_checkpointing

    model = tiny_moe(aux_loss_coef=0.05, capacity_factor=1.0).train()
    with torch.no_grad():
        for _, layer in moe_layers(model):
            layer.router.weight[0] += 0.5
    checkpointed = apply_activation_checkpointing(copy.deepcopy(model), policy=policy)
    generator = torch.Generator().manual_seed(2)
    for _ in range(2):
        tokens = torch.randint(0, 64, (4, 17), generator=generator)
        expected, got = model_gradients(model, tokens), model_gradients(checkpointed, tokens)
        assert_all_close(list(got.values()), [expected[name] for name in got], names=list(got))
    for (name, layer), (_, recomputed) in zip(moe_layers(model), moe_layers(checkpointed), strict=True):
        once, with_recompute = layer.take_step_statistics(), recomputed.take_step_statistics()
        assert once[1] > 0, name  # capacity binds
        for a, b in zip(once, with_recompute, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
        assert once[2][1] == 2  # two balance losses summed


# --- bias balancing --------------------------------------------------------------------------------------------


def test_update_bias_moves_towards_the_mean_load():
    layer = make_layer(bias_update_rate=0.25)
    layer.expert_bias.copy_(torch.tensor([0.0, 1.0, 0.0, -1.0]))
    layer.update_bias(torch.tensor([10, 2, 6, 6]))
    assert layer.expert_bias.tolist() == [-0.25, 1.25, 0.0, -1.0]
    off = make_layer(bias_update_rate=0.0)
    off.update_bias(torch.tensor([10, 2, 6, 6]))
    assert off.expert_bias.tolist() == [0.0, 0.0, 0.0, 0.0]


def imbalance_after_training(rate: float, steps: int = 40) -> float:
    """max / mean load of a one-layer model whose router starts skewed towards expert 0, trained ``steps`` SGD
    steps on random tokens with the bias updated after each: the mean over the last 10 steps."""
    torch.manual_seed(0)
    model = build_moe(MoEConfig(flavour="micro", n_layer=1, n_experts=4, top_k=2, aux_loss_coef=0.0,
                                bias_update_rate=rate), SPEC).train()
    (_, layer), = moe_layers(model)
    direction = torch.ones(32) / math.sqrt(32)
    with torch.no_grad():  # every token's hidden state leans along one direction that expert 0's router row reads
        layer.router.weight.normal_(0.0, 0.1)
        layer.router.weight[0] += 0.4 * direction
        model.embed.tok.weight += 0.1 * direction
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.Generator().manual_seed(1)
    ratios = []
    for _ in range(steps):
        batch = torch.randint(0, 64, (8, 33), generator=tokens)
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        load, _, _ = layer.take_step_statistics()
        layer.update_bias(load)
        ratios.append(load.max().item() / load.float().mean().item())
    assert ratios[0] > 1.8  # skewed at the start: expert 0 in nearly every token's top 2
    return sum(ratios[-10:]) / 10


def test_bias_balancing_evens_the_load_of_a_skewed_router():
    """Measured: 1.24 with a rate of 0.02 (the load a step's 512 assignments give fluctuates around balance),
    2.00 without."""
    assert imbalance_after_training(0.02) < 1.5
    assert imbalance_after_training(0.0) > 1.8
