"""The fp32 warm-up before a codec starts (``comm.warmup_steps``): the exchanged gradients are exactly the
uncompressed mean while it lasts and compressed after it, it counts optimiser steps rather than accumulation
micro-batches, and a run resumed inside or past it continues bitwise."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from disttrain.comm.counter import ByteCounter, ring_allreduce_bytes
from tests.dist_utils import run_on_ranks
from tests.test_comm import PSGD_RANK, psgd_model

WARMUP, STEPS, MICRO = 2, 4, 2


def _batch(step: int, micro: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(10_000 * step + 100 * micro + dist.get_rank())
    return torch.randn(8, 24, generator=generator)


def _run(codec: str, warmup: int, steps: range, micro_batches: int = 1, saved: dict | None = None,
         ) -> tuple[list[tuple[list[torch.Tensor], int]], dict]:
    """Each optimiser step's exchanged gradients and bytes sent, for ``steps`` of a DDP model under ``codec``
    (``micro_batches`` accumulated per step, syncing on the last one, as the training task does), starting
    from the exchange state ``saved``; and the exchange state after them."""
    from torch.nn.parallel import DistributedDataParallel

    from disttrain.comm.config import CommConfig
    from disttrain.comm.hooks import register_compression
    from disttrain.comm.state import ExchangeState, ExchangeStateCheckpoint
    from disttrain.parallel.fsdp import set_gradient_sync

    model = psgd_model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.004)
    counter, state = ByteCounter(), ExchangeState()
    register_compression(ddp, CommConfig(name=codec, rank=PSGD_RANK, warmup_steps=warmup), counter, state)
    if saved is not None:
        ExchangeStateCheckpoint(state).restore(saved, same_world=True)
    results = []
    for step in steps:
        before = counter.bytes_sent
        ddp.zero_grad()
        for micro in range(micro_batches):
            set_gradient_sync(ddp, micro == micro_batches - 1)
            ddp(_batch(step, micro)).pow(2).mean().backward()
        results.append(([param.grad.clone() for param in model.parameters()], counter.bytes_sent - before))
    return results, ExchangeStateCheckpoint(state).own_state()


def _uncompressed_means(world: int, steps: int, micro_batches: int = 1) -> list[list[torch.Tensor]]:
    """Every step's gradients averaged over the ranks in fp32, computed in one process."""
    model = psgd_model()
    means = []
    for step in range(steps):
        per_rank = []
        for rank in range(world):
            model.zero_grad()
            for micro in range(micro_batches):
                generator = torch.Generator().manual_seed(10_000 * step + 100 * micro + rank)
                model(torch.randn(8, 24, generator=generator)).pow(2).mean().backward()
            per_rank.append([param.grad.clone() for param in model.parameters()])
        means.append([sum(grads[i] for grads in per_rank) / world for i in range(len(per_rank[0]))])
    return means


def _warmup_then_codec(codec: str) -> list[tuple[list[torch.Tensor], int]]:
    return _run(codec, WARMUP, range(STEPS), micro_batches=MICRO)[0]


@pytest.mark.parametrize("codec", ["onebit", "powersgd"])
def test_warmup_sends_the_uncompressed_mean_for_its_optimiser_steps_then_the_codec(codec):
    world = 2
    by_rank = run_on_ranks(_warmup_then_codec, world, codec)
    expected = _uncompressed_means(world, STEPS, MICRO)
    numel = sum(param.numel() for param in psgd_model().parameters())
    for step in range(STEPS):
        grads, sent = by_rank[0][step]
        assert all(torch.equal(a, b) for a, b in zip(grads, by_rank[1][step][0], strict=True))  # replicas agree
        close = all(torch.allclose(ours, exact, rtol=1e-6, atol=1e-7)
                    for ours, exact in zip(grads, expected[step], strict=True))
        # MICRO micro-batches per step: counting them would end the warm-up after the first optimiser step
        if step < WARMUP:
            assert close, step
            assert sent == ring_allreduce_bytes(numel, 4, world)
        else:
            assert not close, step
            assert sent < ring_allreduce_bytes(numel, 4, world) / 2


def _interrupted(codec: str) -> tuple[list, dict[int, list]]:
    """The uninterrupted run's gradients, and the same steps run as two processes' worth for each stop: the
    steps before it, then a fresh model and exchange resumed from the first part's checkpointed exchange
    state."""
    whole, _ = _run(codec, WARMUP, range(STEPS))
    resumed = {}
    for stop in (1, 3):  # inside the warm-up, past it
        first, saved = _run(codec, WARMUP, range(stop))
        resumed[stop] = first + _run(codec, WARMUP, range(stop, STEPS), saved=saved)[0]
    return whole, resumed


@pytest.mark.parametrize("codec", ["onebit", "powersgd"])
def test_a_resumed_exchange_continues_the_warmup_or_the_compression_bitwise(codec):
    for whole, resumed in run_on_ranks(_interrupted, 2, codec):
        for stop, steps in resumed.items():
            for (ours, sent), (theirs, their_sent) in zip(steps, whole, strict=True):
                assert sent == their_sent, stop
                assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), stop


def test_the_exchange_count_survives_a_resume_on_another_world_size():
    from disttrain.comm.state import ExchangeState, ExchangeStateCheckpoint

    state = ExchangeState()
    ExchangeStateCheckpoint(state).restore({"exchanges": 7, "residuals": {"all/send": torch.ones(3)}},
                                           same_world=False)
    assert state.exchanges == 7 and not state.feedback.residuals  # residuals follow the world size's chunks


def test_a_negative_warmup_is_refused_before_ranks_start(tmp_path):
    from disttrain.config import validate
    from disttrain.errors import ConfigError
    from tests.conftest import compose_config

    with pytest.raises(ConfigError, match=r"^comm.warmup_steps=-1 is invalid: a number of optimiser steps >= 0$"):
        validate(compose_config(["parallel=ddp", "trainer.devices=2", "comm=onebit", "comm.warmup_steps=-1"],
                                tmp_path / "run"))
