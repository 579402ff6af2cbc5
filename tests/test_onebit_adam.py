"""1-bit Adam on 2 ranks: AdamW during the warm-up, then the algorithm's compressed-momentum step computed by hand
in one process, the bytes it counts are the bytes it sends, and a resume continues its frozen variance and
residuals."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from disttrain.comm.counter import ByteCounter, ring_allreduce_bytes
from disttrain.comm.state import ExchangeState
from disttrain.optim.groups import param_groups
from disttrain.optim.onebit_adam import OneBitAdam
from tests.dist_utils import run_on_ranks, sent_bytes_during, written_bytes

WORLD, WARMUP, STEPS = 2, 3, 6
LR, BETAS, EPS, DECAY = 0.01, (0.9, 0.99), 1e-8, 0.1
TOLERANCE = 1e-6  # fp32; measured: at most 1e-9 between the ranks' weights and the one-process reference


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))  # 212 values: one 106-value chunk a rank


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator)


def loss_of(net: nn.Module, rank: int, step: int) -> torch.Tensor:
    inputs, targets = batch(rank, step)
    return ((net(inputs) - targets) ** 2).mean()


def onebit_adam(net: nn.Module, warmup: int = WARMUP) -> OneBitAdam:
    return OneBitAdam(param_groups(net, DECAY), warmup, lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY)


def _train(resume_at: int | None = None) -> dict:
    """This rank's weights after every step, bytes counted per step and the second moments; with ``resume_at``,
    the optimiser, model and exchange are rebuilt from their saved state after that many steps."""
    rank = dist.get_rank()
    ddp = DistributedDataParallel(tiny_model())
    optimizer, counter, state = onebit_adam(ddp), ByteCounter(), ExchangeState()
    optimizer.attach(ddp, counter, state)
    weights, counted, variances = [], [], []
    for step in range(STEPS):
        if step == resume_at:
            saved = ({k: v.clone() for k, v in ddp.module.state_dict().items()}, optimizer.state_dict(),
                     state.state_dict())
            ddp = DistributedDataParallel(tiny_model())
            ddp.module.load_state_dict(saved[0])
            optimizer, state = onebit_adam(ddp), ExchangeState()
            optimizer.load_state_dict(saved[1])
            state.load_state_dict(saved[2])
            optimizer.attach(ddp, counter, state)
        before = counter.bytes_sent

        def closure(net: nn.Module = ddp, optimizer: OneBitAdam = optimizer, step: int = step) -> torch.Tensor:
            optimizer.zero_grad()
            loss = loss_of(net, rank, step)
            loss.backward()
            return loss

        optimizer.step(closure)  # as Lightning steps: the backward pass, and so the exchange, inside the step
        counted.append(counter.bytes_sent - before)
        weights.append([p.detach().clone() for p in ddp.module.parameters()])
        variances.append([optimizer.state[p]["exp_avg_sq"].clone() for p in ddp.module.parameters()])
    return {"weights": weights, "counted": counted, "variances": variances}


def sign_compressed(rows: torch.Tensor) -> torch.Tensor:
    """Each row as its signs times its mean magnitude (every chunk here is one block of scales)."""
    return torch.where(rows >= 0, 1.0, -1.0) * rows.abs().mean(dim=1, keepdim=True)


def reference() -> list[list[torch.Tensor]]:
    """The weights after every step in one process: AdamW on the mean loss for the warm-up, then each rank's
    momentum from its own gradient, averaged through sign compression with worker and server residuals, and the
    step with the warm-up's variance."""
    net = tiny_model()
    params = [p for group in param_groups(net, DECAY) for p in group["params"]]  # the optimiser's payload order
    adamw = torch.optim.AdamW(param_groups(net, DECAY), lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY)
    weights = []
    for step in range(WARMUP):
        adamw.zero_grad()
        (sum(loss_of(net, rank, step) for rank in range(WORLD)) / WORLD).backward()
        adamw.step()
        weights.append([p.detach().clone() for p in net.parameters()])
    momentum = torch.cat([adamw.state[p]["exp_avg"].reshape(-1) for p in params])
    variance = torch.cat([adamw.state[p]["exp_avg_sq"].reshape(-1) for p in params])
    decay = torch.cat([torch.full((p.numel(),), DECAY if p.ndim >= 2 else 0.0) for p in params])
    numel = momentum.numel()
    chunk = -(-numel // WORLD)
    worker_error = [torch.zeros(WORLD, chunk) for _ in range(WORLD)]
    server_error = [torch.zeros(1, chunk) for _ in range(WORLD)]
    for step in range(WARMUP, STEPS):
        sent = []
        for rank in range(WORLD):
            net.zero_grad()
            loss_of(net, rank, step).backward()
            local = BETAS[0] * momentum + (1 - BETAS[0]) * torch.cat([p.grad.reshape(-1) for p in params])
            wanted = torch.nn.functional.pad(local, (0, chunk * WORLD - numel)).view(WORLD, chunk) + worker_error[rank]
            sent.append(sign_compressed(wanted))
            worker_error[rank] = wanted - sent[-1]
        owned = []
        for owner in range(WORLD):
            wanted = sum(sent[rank][owner] for rank in range(WORLD)).view(1, chunk) / WORLD + server_error[owner]
            owned.append(sign_compressed(wanted))
            server_error[owner] = wanted - owned[-1]
        momentum = torch.cat(owned, dim=1).view(-1)[:numel]
        flat = torch.cat([p.detach().reshape(-1) for p in params]) * (1 - LR * decay)
        denom = variance.sqrt() / math.sqrt(1 - BETAS[1] ** WARMUP) + EPS
        flat -= LR / (1 - BETAS[0] ** (step + 1)) * momentum / denom
        with torch.no_grad():
            offset = 0
            for p in params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        weights.append([p.detach().clone() for p in net.parameters()])
    return weights


def max_difference(left: list[torch.Tensor], right: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(left, right, strict=True))


@pytest.fixture(scope="module")
def uninterrupted() -> list[dict]:
    return run_on_ranks(_train, WORLD)


def test_warmup_is_adamw_and_then_the_compressed_momentum_step_with_frozen_variance(uninterrupted):
    expected = reference()
    for ranks in uninterrupted:
        assert all(max_difference(w, uninterrupted[0]["weights"][step]) == 0  # replicas stay identical
                   for step, w in enumerate(ranks["weights"]))
        for step in range(STEPS):
            assert max_difference(ranks["weights"][step], expected[step]) < TOLERANCE, step
        # the variance moves during the warm-up only
        assert max_difference(ranks["variances"][WARMUP - 2], ranks["variances"][WARMUP - 1]) > 0
        assert all(max_difference(ranks["variances"][WARMUP - 1], later) == 0 for later in ranks["variances"][WARMUP:])


def test_it_counts_fp32_gradients_in_the_warmup_then_one_bit_a_value_and_a_scale_per_chunk(uninterrupted):
    numel, chunk = 212, 106
    compressed = 2 * (WORLD - 1) * (-(-chunk // 8) + 4)  # signs, 8 a byte, and one float32 scale, in both phases
    for ranks in uninterrupted:
        assert ranks["counted"] == [ring_allreduce_bytes(numel, 4, WORLD)] * WARMUP + [compressed] * (STEPS - WARMUP)


def test_a_resume_after_the_warmup_continues_the_frozen_variance_and_the_residuals(uninterrupted):
    resumed = run_on_ranks(_train, WORLD, WARMUP + 1)
    for ranks, whole in zip(resumed, uninterrupted, strict=True):
        assert all(max_difference(a, b) == 0 for a, b in zip(ranks["weights"], whole["weights"], strict=True))


def _counted_and_written() -> tuple[int, int | None]:
    """Bytes counted and bytes all ranks wrote over 3 compressed steps of a model of 1 M values."""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Linear(1000, 1000))
    optimizer, counter = onebit_adam(ddp, warmup=1), ByteCounter()
    optimizer.attach(ddp, counter, ExchangeState())
    inputs = torch.randn(8, 1000, generator=torch.Generator().manual_seed(dist.get_rank()))

    def step() -> None:
        optimizer.zero_grad()
        ddp(inputs).square().mean().backward()
        optimizer.step()

    step()  # the fp32 warm-up
    before = counter.bytes_sent
    written = sent_bytes_during(lambda: [step() for _ in range(3)])
    return counter.bytes_sent - before, written


def test_after_the_warmup_the_counted_bytes_are_all_the_ranks_send():
    if written_bytes() is None:
        pytest.skip("no /proc/self/io write counters on this system")
    by_rank = run_on_ranks(_counted_and_written, WORLD)
    counted = sum(sent for sent, _ in by_rank)
    chunk = 1_001_000 // WORLD
    assert counted == WORLD * 3 * 2 * (WORLD - 1) * (-(-chunk // 8) + 4 * -(-chunk // 256))
    # DDP's own all-reduce would add 4 MB a step; gloo's barriers add a little
    assert by_rank[0][1] == pytest.approx(counted, rel=0.02)


def test_a_run_reports_the_bytes_after_the_warmup_beside_the_whole_runs(tmp_path):
    import json

    from disttrain.launch.job import train
    from tests.conftest import compose_config

    train(compose_config(["parallel=ddp", "trainer.devices=2", "trainer.max_steps=8", "trainer.run_test=false",
                          "trainer.limit_val_batches=1", "logger=none", "callbacks=none", "optim=onebit_adam",
                          "optim.warmup_steps=2"], tmp_path))
    comm = json.loads((tmp_path / "results.json").read_text())["comm"]
    fp32, after = comm["fp32_allreduce_bytes_per_step"], comm["bytes_sent_per_step_after_warmup"]
    assert comm["name"] == "onebit_adam" and comm["counted"] and comm["warmup_steps"] == 2
    assert comm["bytes_sent_per_step"] == round((2 * fp32 + 6 * after) / 8)  # 2 fp32 steps, 6 compressed
    assert comm["compression_ratio_after_warmup"] > 25


def test_onebit_adam_is_refused_where_ddp_does_not_average_or_a_codec_compresses(tmp_path):
    from disttrain.config import validate
    from disttrain.errors import ConfigError
    from tests.conftest import compose_config

    for overrides, message in ((["parallel=zero3", "trainer.devices=2"], "parallel=ddp with data-parallel ranks"),
                               (["parallel=zero1", "trainer.devices=2"], "parallel=ddp with data-parallel ranks"),
                               (["parallel=single"], "parallel=ddp with data-parallel ranks"),
                               (["parallel=ddp", "trainer.devices=2", "comm=onebit"], "none with optim=onebit_adam"),
                               (["optim.warmup_steps=0"], "optimiser steps >= 1")):
        with pytest.raises(ConfigError, match=message):
            validate(compose_config(["optim=onebit_adam", *overrides], tmp_path / "run"))


def test_the_planner_prices_two_moments_and_the_worker_residual():
    from disttrain.plan.layout import state_bytes

    assert state_bytes("onebit_adam").optim == state_bytes("adamw").optim + 4
