"""Compressed gradient exchange: the compressed mean equals a one-process simulation of the same algorithm,
bytes follow 2 (N - 1) / N of the encoded size, and a compressed DDP run trains like an uncompressed one."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

from disttrain.comm.codecs import SCALE_BLOCK, CastCodec, Int8Codec, SignCodec
from disttrain.comm.counter import ByteCounter, ring_allreduce_bytes
from disttrain.comm.exchange import ErrorFeedback, compressed_mean
from tests.dist_utils import run_on_ranks, sent_bytes_during, written_bytes

NUMEL = 1001  # not a multiple of the world size: the padding is exercised
TOLERANCE = {"fp16": 3e-4, "bf16": 3e-4}  # measured over 30 steps: 1.0e-4 (fp16), 1.1e-4 (bf16) relative


def rank_values(rank: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 + rank)) * 10 ** (rank - 1)


DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def codecs() -> list:
    """The codecs exchanged by every rank, in order: fp32, fp16, bf16 casts, int8, onebit."""
    return [*(CastCodec(dtype) for dtype in DTYPES), Int8Codec(), SignCodec()]


def _exchange() -> list[tuple[torch.Tensor, int]]:
    """This rank's compressed mean and bytes sent, for each codec."""
    torch.manual_seed(dist.get_rank())  # int8's stochastic rounding draws from the global generator
    results = []
    for codec in codecs():
        counter = ByteCounter()
        results.append((compressed_mean(rank_values(dist.get_rank()), codec, counter=counter), counter.bytes_sent))
    return results


def simulate(codec, world: int) -> torch.Tensor:
    """The exchange in one process: each rank's chunks encoded, the owner's fp32 sum encoded back."""
    chunk = -(-NUMEL // world)
    padded = torch.stack([torch.nn.functional.pad(rank_values(r), (0, chunk * world - NUMEL))
                          for r in range(world)]).view(world, world, chunk)
    decoded = torch.stack([codec.decode(codec.encode(rows), chunk) for rows in padded])
    owned = decoded.sum(dim=0) / world  # row j: the mean chunk rank j owns
    return codec.decode(codec.encode(owned), chunk).flatten()[:NUMEL]


@pytest.mark.parametrize("world", [2, 4])
def test_compressed_mean_is_the_simulated_algorithm_and_its_bytes_follow_the_ring(world):
    exact = torch.stack([rank_values(r) for r in range(world)]).mean(dim=0)
    by_rank = run_on_ranks(_exchange, world)
    full, half, brain, int8, onebit = ([by_rank[r][i] for r in range(world)] for i in range(len(codecs())))
    chunk = -(-NUMEL // world)
    for results, codec in zip((full, half, brain, int8, onebit), codecs(), strict=True):
        means = [mean for mean, _ in results]
        assert all(torch.equal(means[0], other) for other in means[1:])  # every replica gets the same values
        if not isinstance(codec, Int8Codec):  # int8 rounds with each rank's own draws
            assert torch.equal(means[0], simulate(codec, world))
    assert torch.allclose(full[0][0], exact, rtol=1e-6, atol=1e-6)
    # int8: within two steps of the code grid of the largest chunk (one rounding per phase)
    assert (int8[0][0] - exact).abs().max() <= 2 * max(rank_values(r).abs().max() for r in range(world)) / 127
    # bytes per rank: 2 (N - 1) / N of the (padded) payload; fp16 / bf16 exactly half of fp32; int8 one byte a
    # value and onebit one bit a value, with a 4-byte scale per block of SCALE_BLOCK values
    assert full[0][1] == ring_allreduce_bytes(chunk * world, 4, world)
    assert [b for _, b in half] == [full[0][1] // 2] * world == [b for _, b in brain]
    assert [b for _, b in int8] == [2 * (world - 1) * (chunk + 4 * -(-chunk // SCALE_BLOCK))] * world
    assert [b for _, b in onebit] == [2 * (world - 1) * (-(-chunk // 8) + 4 * -(-chunk // SCALE_BLOCK))] * world


def test_int8_rounding_is_unbiased():
    values = torch.linspace(-1.0, 1.0, 257).view(1, -1) * 0.37
    codec, draws = Int8Codec(), 4000
    torch.manual_seed(0)
    mean = sum(codec.decode(codec.encode(values), values.shape[1]) for _ in range(draws)) / draws
    step = values.abs().max() / 127
    # each decoded value is one of the two grid points around it; their average converges on the value
    assert (mean - values).abs().max() <= 0.005 * values.abs().max()
    assert (codec.decode(codec.encode(values), 257) - values).abs().max() <= step


def test_int8_keeps_a_grid_per_block():
    small, large = torch.linspace(-1e-3, 1e-3, 4), torch.linspace(-10.0, 10.0, 4)
    values = torch.cat([small, large, small[:1]]).view(1, -1)
    codec = Int8Codec(block=4)
    torch.manual_seed(0)
    decoded = codec.decode(codec.encode(values), values.shape[1])
    # each value within one step of its own block's grid (largest magnitude / 127), the small ones included
    steps = torch.tensor([1e-3] * 4 + [10.0] * 4 + [1e-3]) / 127
    assert ((decoded - values).abs() <= steps * (1 + 1e-6)).all()
    assert codec.encode(values).numel() == 9 + 3 * 4  # a byte a value, and three scales


def test_onebit_sends_signs_and_the_mean_magnitude():
    values = torch.tensor([[0.5, -2.0, 0.0, 3.5, -1.0, 0.25, -0.25, 7.0, -0.5]])
    decoded = SignCodec().decode(SignCodec().encode(values), values.shape[1])
    scale = values.abs().mean()
    assert torch.equal(decoded, torch.where(values >= 0, scale, -scale))
    assert SignCodec().encode(values).numel() == 2 + 4  # 9 signs in 2 bytes, and the scale


def test_onebit_keeps_a_mean_magnitude_per_block():
    values = torch.tensor([[0.5, -2.0, 0.0, 3.5, -100.0, 100.0, -300.0, 300.0, -0.5]])
    codec = SignCodec(block=4)
    decoded = codec.decode(codec.encode(values), values.shape[1])
    # blocks of 4, the last one short: each value is sent at its own block's mean magnitude
    scales = torch.tensor([1.5, 1.5, 1.5, 1.5, 200.0, 200.0, 200.0, 200.0, 0.5])
    assert torch.equal(decoded, torch.where(values >= 0, scales, -scales))
    assert codec.encode(values).numel() == 2 + 3 * 4  # 9 signs in 2 bytes, and three scales


@pytest.mark.parametrize("codec", [Int8Codec(), SignCodec()], ids=["int8", "onebit"])
def test_what_was_sent_plus_the_residual_is_what_went_in(codec):
    feedback = ErrorFeedback()
    torch.manual_seed(1)
    for step in range(3):  # the residual of one step rides on the next
        values = torch.randn(4, 33)
        wanted = feedback.apply("b/send", values)
        sent = codec.decode(codec.encode(wanted), 33)
        feedback.keep("b/send", wanted, sent)
        assert torch.allclose(sent + feedback.residuals["b/send"], wanted, atol=1e-6)
        if step:
            assert not torch.equal(wanted, values)


RUN = ["parallel=ddp", "trainer.devices=2", "trainer.max_steps=30", "trainer.log_every_n_steps=1",
       "trainer.run_test=false", "logger=csv", "callbacks=none", "optim=sgd", "optim.lr=0.05",
       "trainer.gradient_clip_val=0.5"]


@pytest.fixture(scope="module")
def uncompressed(tmp_path_factory):
    from disttrain.launch.job import train
    from tests.conftest import compose_config

    run_dir = tmp_path_factory.mktemp("none")
    train(compose_config([*RUN, "comm=none"], run_dir))
    return run_dir


@pytest.mark.parametrize("codec", ["fp16", "bf16"])
def test_a_compressed_ddp_run_sends_half_the_bytes_and_trains_as_the_uncompressed_one(uncompressed, tmp_path, codec):
    import json

    from disttrain.launch.job import train
    from tests.conftest import compose_config
    from tests.test_run import step_losses

    run_dir = tmp_path / codec
    train(compose_config([*RUN, f"comm={codec}"], run_dir))
    comm = json.loads((run_dir / "results.json").read_text())["comm"]
    reference = json.loads((uncompressed / "results.json").read_text())["comm"]
    assert comm["counted"] and not reference["counted"]
    assert comm["fp32_allreduce_bytes_per_step"] == reference["bytes_sent_per_step"]
    # one payload per step, padded to a multiple of the 2 ranks; each rank sends 2 (N - 1) / N of it, 2 bytes a value
    numel = reference["bytes_sent_per_step"] // 4  # a 2-rank ring all-reduce sends 4 bytes per fp32 value
    assert comm["bytes_sent_per_step"] == ring_allreduce_bytes(-(-numel // 2) * 2, 2, 2)
    assert comm["compression_ratio"] == round(reference["bytes_sent_per_step"] / comm["bytes_sent_per_step"], 4)
    # SGD with binding clipping: the rounded gradients move the curve by their rounding only
    ours, theirs = step_losses(run_dir), step_losses(uncompressed)
    assert ours != theirs  # the codec really changed what was sent
    assert ours == pytest.approx(theirs, rel=TOLERANCE[codec])


def test_zero2_reduces_gradients_in_the_wire_dtype(uncompressed, tmp_path):
    import json

    from disttrain.launch.job import train
    from tests.conftest import compose_config
    from tests.test_run import step_losses

    run_dir = tmp_path / "zero2-bf16"
    train(compose_config([*RUN, "comm=bf16", "parallel=zero2"], run_dir))
    comm = json.loads((run_dir / "results.json").read_text())["comm"]
    numel = json.loads((uncompressed / "results.json").read_text())["comm"]["bytes_sent_per_step"] // 4
    # FSDP2's own collectives, from the formula: half the bf16 gradients reduce-scattered, half the fp32
    # parameters all-gathered (a 2-rank fp32 all-reduce: 4 bytes a value)
    assert not comm["counted"] and comm["bytes_sent_per_step"] == numel + 2 * numel
    ours, theirs = step_losses(run_dir), step_losses(uncompressed)  # ZeRO-2 in fp32 is DDP's curve to 1e-6
    assert ours != theirs
    assert ours == pytest.approx(theirs, rel=TOLERANCE["bf16"])  # measured: 1.3e-4


def test_codecs_are_refused_where_they_cannot_carry_the_gradients(tmp_path):
    from disttrain.config import validate
    from disttrain.errors import ConfigError
    from tests.conftest import compose_config

    for overrides, message in ((["parallel=zero3", "comm=powersgd"], "one of none, fp16, bf16 with ZeRO-3"),
                               (["parallel=ddp", "comm=powersgd", "comm.rank=40"], "at most 28: above it no"),
                               (["comm=onebit", "comm.warmup_steps=-2"], "a number of optimiser steps >= 0"),
                               (["parallel=single", "comm=bf16"], "without data-parallel ranks"),
                               (["comm.name=zip"], "one of none, fp16, bf16")):
        with pytest.raises(ConfigError, match=message):
            validate(compose_config(overrides, tmp_path / "run"))


def test_an_unset_powersgd_rank_is_16_or_the_largest_this_model_can_use(tmp_path):
    from disttrain.comm.config import DEFAULT_POWERSGD_RANK
    from disttrain.config import validate
    from tests.conftest import compose_config

    micro = validate(compose_config(["parallel=ddp", "trainer.devices=2", "comm=powersgd", "model=gpt",
                                     "model.flavour=micro", "data=pydocs"], tmp_path / "micro"))
    nano = validate(compose_config(["parallel=ddp", "trainer.devices=2", "comm=powersgd", "model=gpt",
                                    "model.flavour=nano", "data=pydocs"], tmp_path / "nano"))
    assert (micro.train.comm.rank, nano.train.comm.rank) == (14, DEFAULT_POWERSGD_RANK)
    assert "rank: 14" in micro.yaml  # the ranks read the rank taken


def digits_run(tmp_path_factory, name: str, overrides: list[str]) -> dict:
    """The default digits run on 2 DDP ranks with ``overrides``; its results."""
    import json

    from disttrain.launch.job import train
    from tests.conftest import compose_config

    run_dir = tmp_path_factory.mktemp(name)
    train(compose_config(["parallel=ddp", "trainer.devices=2", "logger=csv", "callbacks=none", *overrides], run_dir))
    return json.loads((run_dir / "results.json").read_text())


@pytest.fixture(scope="module")
def digits_uncompressed(tmp_path_factory) -> dict:
    return digits_run(tmp_path_factory, "digits-none", ["comm=none"])


@pytest.fixture(scope="module")
def digits_compressed(tmp_path_factory):
    """``codec -> results`` of the digits run compressed from the first step (powersgd after two steps) with error
    feedback, each run once for this module."""
    warmups = {"powersgd": 2}
    return functools.cache(lambda codec: digits_run(
        tmp_path_factory, codec, [f"comm={codec}", f"comm.warmup_steps={warmups.get(codec, 0)}", "comm.rank=4"]))


@pytest.mark.parametrize(("codec", "ratio", "points"), [("powersgd", 8.77, 1), ("int8", 3.93, 2), ("onebit", 28.4, 2)])
def test_compressed_runs_with_error_feedback_reach_the_uncompressed_accuracy(
        digits_uncompressed, digits_compressed, codec, ratio, points):
    # compressed from the first steps (the default warm-ups would leave most of these 190 steps in fp32)
    results = digits_compressed(codec)
    # powersgd rank 4 on this CNN: 9.56x once compressing (its matrices have 32 or 64 rows); 8.77x over the 190
    # steps, the two fp32 warm-up steps included; int8 and onebit with a 4-byte scale per 256 values
    assert results["comm"]["compression_ratio"] >= ratio
    # measured: none 0.9861, powersgd 0.9805, int8 0.9861, onebit 0.9889 test accuracy (359 images)
    assert results["metrics"]["test/acc"] >= digits_uncompressed["metrics"]["test/acc"] - points / 100


def test_onebit_without_error_feedback_is_measurably_worse(digits_compressed, tmp_path_factory):
    # the verdict is the training loss, which validation, test and saves leave as it is: the run without error
    # feedback trains alone (they took half its time), beside the run with it that the test above made
    with_feedback = digits_compressed("onebit")
    without = digits_run(tmp_path_factory, "onebit-no-ef", [
        "comm=onebit", "comm.warmup_steps=0", "comm.error_feedback=false", "trainer.limit_val_batches=0",
        "trainer.run_test=false", "checkpoint.save_last=false", "checkpoint.save_top_k=0"])
    # the bias that error feedback corrects is the optimiser's, so the training loss shows it: the last epoch's
    # mean 0.0267 with error feedback, 0.0464 without (1.74x) on an AMD EPYC. The test loss of the checkpoint
    # that validation accuracy picks is noisier: 0.043 vs 0.084 on an Intel Xeon, 0.065 vs 0.082 on the EPYC
    assert without["metrics"]["train/loss_epoch"] > 1.4 * with_feedback["metrics"]["train/loss_epoch"]


# PowerSGD: a model with matrices that compress at rank 4 (40 x 24, 40 x 40), one that does not (3 x 40:
# (3 + 40) x 3 > 120 values) and vectors, exchanged by DDP in buckets of a few KiB (several buckets per step)
PSGD_RANK, PSGD_WARMUP, PSGD_STEPS = 4, 2, 6


def psgd_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Tanh(), torch.nn.Linear(40, 40), torch.nn.Tanh(),
                               torch.nn.Linear(40, 3))


def psgd_local_grads(model: torch.nn.Module, rank: int, step: int) -> list[torch.Tensor]:
    data = torch.Generator().manual_seed(1000 * step + rank)
    model.zero_grad()
    model(torch.randn(8, 24, generator=data)).pow(2).mean().backward()
    return [param.grad.clone() for param in model.parameters()]


def _powersgd_exchange() -> list[tuple[list[torch.Tensor], int]]:
    """Each step's averaged gradients and the bytes this rank sent for them, under DDP with small buckets."""
    from torch.nn.parallel import DistributedDataParallel

    from disttrain.comm.config import CommConfig
    from disttrain.comm.hooks import register_compression
    from disttrain.comm.state import ExchangeState

    model = psgd_model()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.004)
    counter = ByteCounter()
    register_compression(ddp, CommConfig(name="powersgd", rank=PSGD_RANK, warmup_steps=PSGD_WARMUP), counter,
                         ExchangeState())
    results = []
    for step in range(PSGD_STEPS):
        before = counter.bytes_sent
        data = torch.Generator().manual_seed(1000 * step + dist.get_rank())
        ddp.zero_grad()
        ddp(torch.randn(8, 24, generator=data)).pow(2).mean().backward()
        results.append(([param.grad.clone() for param in model.parameters()], counter.bytes_sent - before))
    return results


def simulate_powersgd(world: int) -> list[list[torch.Tensor]]:
    """PowerSGD in one process, written from the paper and torch's hook: rank-r factors of every matrix that
    they make at least 2x smaller, P summed then orthonormalised, Q averaged, residuals kept per rank, Q warm
    started (its first draw as torch's hook makes it, matrices grouped by shape)."""
    import numpy as np
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize

    model = psgd_model()
    shapes = [param.shape for param in model.parameters()]
    compressed = [i for i, s in enumerate(shapes) if len(s) == 2 and (s[0] + s[1]) * min(*s, PSGD_RANK) * 2
                  <= s[0] * s[1]]
    by_shape: dict = {}
    for i in compressed:
        by_shape.setdefault(shapes[i], []).append(i)
    order = [i for group in by_shape.values() for i in group]  # torch's hook walks matrices by shape
    errors: list = [None] * world
    qs: dict[int, torch.Tensor] = {}
    means = []
    for step in range(PSGD_STEPS):
        grads = [psgd_local_grads(model, rank, step) for rank in range(world)]
        if step < PSGD_WARMUP:
            means.append([sum(g[i] for g in grads) / world for i in range(len(shapes))])
            continue
        wanted = [[g + e for g, e in zip(grads[r], errors[r], strict=True)] if errors[r] else grads[r]
                  for r in range(world)]
        if not qs:
            seed = np.random.RandomState(0).randint(1_000_000_000)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                for i in order:
                    qs[i] = torch.randn(1, shapes[i][1], min(*shapes[i], PSGD_RANK))
        mean = [sum(w[i] for w in wanted) / world for i in range(len(shapes))]
        for i in order:
            _orthogonalize(qs[i])
            p = sum(w[i].unsqueeze(0) @ qs[i] for w in wanted)
            _orthogonalize(p)
            qs[i] = sum(w[i].unsqueeze(0).transpose(1, 2) @ p for w in wanted) / world
            mean[i] = (p @ qs[i].transpose(1, 2))[0]
        errors = [[w - m for w, m in zip(wanted[r], mean, strict=True)] for r in range(world)]
        means.append(mean)
    return means


def test_powersgd_is_the_simulated_algorithm_and_sends_its_factors_only():
    world = 2
    by_rank = run_on_ranks(_powersgd_exchange, world)
    expected = simulate_powersgd(world)
    shapes = [param.shape for param in psgd_model().parameters()]
    numel = sum(s.numel() for s in shapes)
    # (n + m) r values for each matrix the factors shrink at least 2x (40 x 24, 40 x 40), all of the others
    factors = sum((s[0] + s[1]) * PSGD_RANK for s in shapes if len(s) == 2 and s[0] > PSGD_RANK)
    sent = factors + sum(s.numel() for s in shapes if len(s) == 1 or s[0] <= PSGD_RANK)
    assert sent < numel / 3
    for step in range(PSGD_STEPS):
        grads = [by_rank[r][step][0] for r in range(world)]
        assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1], strict=True))  # replicas agree
        for ours, theirs in zip(grads[0], expected[step], strict=True):  # measured: bitwise equal
            assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-6), step
        values = numel if step < PSGD_WARMUP else sent
        assert [by_rank[r][step][1] for r in range(world)] == [ring_allreduce_bytes(values, 4, world)] * world


def _counted_and_sent_bytes() -> tuple[int, int | None]:
    """Bytes this rank counted for int8 exchanges of 2 M values, and the bytes all ranks wrote meanwhile."""
    values = torch.randn(2_000_000, generator=torch.Generator().manual_seed(dist.get_rank()))
    counter = ByteCounter()

    def exchanges() -> None:
        for _ in range(3):
            compressed_mean(values, Int8Codec(), counter=counter)

    sent = sent_bytes_during(exchanges)
    return counter.bytes_sent, sent


def test_the_counted_bytes_are_the_bytes_the_ranks_send():
    if written_bytes() is None:
        pytest.skip("no /proc/self/io write counters on this system")
    by_rank = run_on_ranks(_counted_and_sent_bytes, 2)
    counted = sum(sent for sent, _ in by_rank)
    sent = by_rank[0][1]
    # gloo over TCP writes every byte it sends; its barriers add a little (measured: 1.00017 times the counted bytes)
    assert counted == 2 * 3 * 2 * (1_000_000 + 4 * -(-1_000_000 // SCALE_BLOCK))  # a 4-byte scale per block
    assert sent == pytest.approx(counted, rel=0.01)
