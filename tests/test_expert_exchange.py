"""The all-to-all exchange of expert parallelism: every row reaches the rank holding its expert exactly once, grouped
by local expert, and its result comes back to its place; gradients travel the same way back."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from disttrain.parallel.experts import ExpertParallel
from tests.dist_utils import run_on_ranks, sent_bytes_during, written_bytes

RANKS, LOCAL_EXPERTS, WIDTH = 4, 2, 3


def _rows_of(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s rows sorted by expert (uneven counts, some experts without rows) and the counts."""
    generator = torch.Generator().manual_seed(rank)
    counts = torch.randint(0, 4, (RANKS * LOCAL_EXPERTS,), generator=generator)
    counts[rank] = 0  # an expert this rank sends nothing to
    rows = torch.randn(int(counts.sum()), WIDTH, generator=generator)
    rows[:, 0] = rank * 100 + torch.arange(len(rows))  # a tag: where the row comes from
    return rows, counts


def _exchange() -> dict:
    rank = dist.get_rank()
    exchange = ExpertParallel(dist.group.WORLD, rank, RANKS)
    rows, counts = _rows_of(rank)
    rows.requires_grad_(True)
    arrived: list = []

    def compute(local: torch.Tensor, local_counts: torch.Tensor) -> torch.Tensor:
        arrived.append((local.detach().clone(), local_counts.clone()))
        experts = rank * LOCAL_EXPERTS + torch.arange(LOCAL_EXPERTS).repeat_interleave(local_counts)
        return local * (experts + 1).unsqueeze(1)  # expert e multiplies its rows by e + 1

    out = exchange.exchange(rows, counts, compute)
    out.backward(torch.ones_like(out))
    return {"rows": rows.detach(), "counts": counts, "out": out.detach(), "grad": rows.grad,
            "arrived": arrived[0][0], "arrived_counts": arrived[0][1], "sent_bytes": exchange.sent_bytes}


def test_rows_reach_their_experts_once_and_come_back_in_order():
    results = run_on_ranks(_exchange, RANKS)
    for rank, got in enumerate(results):
        expert_of_row = torch.arange(RANKS * LOCAL_EXPERTS).repeat_interleave(got["counts"])
        factor = (expert_of_row + 1).unsqueeze(1).float()
        torch.testing.assert_close(got["out"], got["rows"] * factor, rtol=0, atol=0)  # each row back in its place
        torch.testing.assert_close(got["grad"], factor.expand_as(got["rows"]), rtol=0, atol=0)
        # what this rank's experts received: every row sent to them by any rank, once, grouped by local expert
        expected = []
        for local in range(LOCAL_EXPERTS):
            expert = rank * LOCAL_EXPERTS + local
            for source in results:
                start = int(source["counts"][:expert].sum())
                expected.append(source["rows"][start:start + int(source["counts"][expert])])
        torch.testing.assert_close(got["arrived"], torch.cat(expected), rtol=0, atol=0)
        # bytes sent to other ranks: rows out and results back in forward, their gradients both ways in backward
        own = slice(rank * LOCAL_EXPERTS, (rank + 1) * LOCAL_EXPERTS)
        sent = int(got["counts"].sum() - got["counts"][own].sum())
        received = sum(int(source["counts"][own].sum()) for r, source in enumerate(results) if r != rank)
        assert got["sent_bytes"] == 2 * (sent + received) * WIDTH * 4
        assert got["arrived_counts"].tolist() == [
            sum(int(source["counts"][rank * LOCAL_EXPERTS + local]) for source in results)
            for local in range(LOCAL_EXPERTS)]


def _counted_and_sent_bytes() -> tuple[int, int | None]:
    """Bytes this rank's exchange counted for 3 exchanges of 2 x 200,000 rows of 4 values (half to each rank's
    experts), and the bytes all ranks wrote meanwhile."""
    exchange = ExpertParallel(dist.group.WORLD, dist.get_rank(), 2)
    counts = torch.tensor([100_000, 100_000, 100_000, 100_000])  # 2 experts a rank
    rows = torch.randn(int(counts.sum()), 4, requires_grad=True)

    def exchanges() -> None:
        for _ in range(3):
            exchange.exchange(rows, counts, lambda local, _: local * 2).sum().backward()

    sent = sent_bytes_during(exchanges)
    return exchange.sent_bytes, sent


def test_the_counted_bytes_are_the_bytes_the_ranks_send():
    if written_bytes() is None:
        pytest.skip("no /proc/self/io write counters on this system")
    by_rank = run_on_ranks(_counted_and_sent_bytes, 2)
    counted = sum(sent for sent, _ in by_rank)
    # per exchange a rank sends its 200,000 rows for the other's experts, returns the other's 200,000 results, and
    # backward sends both gradients back: 4 x 200,000 x 16 bytes; a rank's rows for its own experts stay home
    assert counted == 2 * 3 * 4 * 200_000 * 16
    # gloo over TCP writes every byte it sends; the counts' all-to-alls and the barriers add a little
    assert by_rank[0][1] == pytest.approx(counted, rel=0.05)
