"""Compressed gradient exchange: the compressed mean equals a one-process simulation of the same algorithm,
bytes follow 2 (N - 1) / N of the encoded size, and a compressed DDP run trains like an uncompressed one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from disttrain.comm.codecs import CastCodec
from disttrain.comm.counter import ByteCounter, ring_allreduce_bytes
from disttrain.comm.exchange import compressed_mean
from tests.dist_utils import run_on_ranks

NUMEL = 1001  # not a multiple of the world size: the padding is exercised
TOLERANCE = {"fp16": 3e-4, "bf16": 3e-4}  # measured over 30 steps: 1.0e-4 (fp16), 1.1e-4 (bf16) relative


def rank_values(rank: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 + rank)) * 10 ** (rank - 1)


DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _exchange() -> list[tuple[torch.Tensor, int]]:
    """This rank's compressed mean and bytes sent, for each wire dtype."""
    results = []
    for dtype in DTYPES:
        counter = ByteCounter()
        results.append((compressed_mean(rank_values(dist.get_rank()), CastCodec(dtype), counter=counter),
                        counter.bytes_sent))
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_compressed_mean_is_the_simulated_algorithm_and_its_bytes_follow_the_ring(world):
    exact = torch.stack([rank_values(r) for r in range(world)]).mean(dim=0)
    by_rank = run_on_ranks(_exchange, world)
    full, half, brain = ([by_rank[r][i] for r in range(world)] for i in range(len(DTYPES)))
    chunk = -(-NUMEL // world)
    for results, dtype in ((full, torch.float32), (half, torch.float16), (brain, torch.bfloat16)):
        means = [mean for mean, _ in results]
        assert all(torch.equal(means[0], other) for other in means[1:])  # every replica gets the same values
        codec = CastCodec(dtype)
        padded = torch.stack([torch.nn.functional.pad(rank_values(r), (0, chunk * world - NUMEL))
                              for r in range(world)]).view(world, world, chunk)
        decoded = torch.stack([codec.decode(codec.encode(rows), chunk) for rows in padded])
        owned = decoded.sum(dim=0) / world  # row j: the mean chunk rank j owns
        simulated = codec.decode(codec.encode(owned), chunk).flatten()
        assert torch.equal(means[0], simulated[:NUMEL])
    assert torch.allclose(full[0][0], exact, rtol=1e-6, atol=1e-6)
    # bytes per rank: 2 (N - 1) / N of the (padded) payload, and fp16 / bf16 exactly half of fp32
    assert full[0][1] == ring_allreduce_bytes(chunk * world, 4, world)
    assert [b for _, b in half] == [full[0][1] // 2] * world == [b for _, b in brain]


RUN = ["parallel=ddp", "trainer.devices=2", "trainer.max_steps=30", "trainer.log_every_n_steps=1",
       "trainer.run_test=false", "logger=csv", "callbacks=none", "optim=sgd", "optim.lr=0.05",
       "trainer.gradient_clip_val=0.5"]


@pytest.fixture(scope="module")
def uncompressed(tmp_path_factory):
    from disttrain.run import train
    from tests.conftest import compose_config

    run_dir = tmp_path_factory.mktemp("none")
    train(compose_config([*RUN, "comm=none"], run_dir))
    return run_dir


@pytest.mark.parametrize("codec", ["fp16", "bf16"])
def test_a_compressed_ddp_run_sends_half_the_bytes_and_trains_as_the_uncompressed_one(uncompressed, tmp_path, codec):
    import json

    from disttrain.run import train
    from tests.conftest import compose_config
    from tests.test_run import step_losses

    run_dir = tmp_path / codec
    train(compose_config([*RUN, f"comm={codec}"], run_dir))
    comm = json.loads((run_dir / "results.json").read_text())["comm"]
    reference = json.loads((uncompressed / "results.json").read_text())["comm"]
    assert comm["counted"] and not reference["counted"]
    assert comm["fp32_allreduce_bytes_per_step"] == reference["bytes_sent_per_step"]
    # each DDP bucket is padded to a multiple of the 2 ranks: at most a few bytes over exactly half
    assert 0 <= comm["bytes_sent_per_step"] - reference["bytes_sent_per_step"] / 2 <= 4 * 2
    assert comm["compression_ratio"] == pytest.approx(2.0, rel=1e-4)
    # SGD with binding clipping: the rounded gradients move the curve by their rounding only
    ours, theirs = step_losses(run_dir), step_losses(uncompressed)
    assert ours != theirs  # the codec really changed what was sent
    assert ours == pytest.approx(theirs, rel=TOLERANCE[codec])


def test_codecs_are_refused_where_gradients_do_not_go_through_ddp(tmp_path):
    from disttrain.config import validate
    from disttrain.errors import ConfigError
    from tests.conftest import compose_config

    for overrides, message in ((["parallel=zero3", "comm=fp16"], "ZeRO-2/3"),
                               (["parallel=single", "comm=bf16"], "without data-parallel ranks"),
                               (["comm.name=zip"], "one of none, fp16, bf16")):
        with pytest.raises(ConfigError, match=message):
            validate(compose_config(overrides, tmp_path / "run"))
