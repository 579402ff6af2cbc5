"""Clients dropping out mid-round: the round completes with the survivors, in the clear and under secure
aggregation (whose dropped clients' masks are rebuilt from Shamir shares), and what leaves a client is masked."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from disttrain.errors import ConfigError
from disttrain.federated import secure
from disttrain.federated.config import FederatedConfig
from disttrain.federated.rounds import flat, state_tensors
from tests.dist_utils import run_on_ranks
from tests.test_federated import _rounds

pytest.importorskip("Crypto")
pytest.importorskip("cryptography")


def _fed(**options) -> FederatedConfig:
    fed = FederatedConfig(clients=10, clients_per_round=10, local_steps=2, batch_size=16, partition="dirichlet",
                          alpha=0.5, dropout=0.3, **options)
    fed.validate()
    return fed


def _one_round_each() -> dict[str, dict]:
    """Round 0 over the ranks, in the clear and masked: the aggregate and the payloads that crossed ranks."""
    sent: list[torch.Tensor] = []
    original = dist.all_reduce

    def recording(tensor, *args, **kwargs):
        sent.append(tensor.detach().clone())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = recording
    results = {}
    for name, options in {"plain": {}, "secure": {"secure_aggregation": True}}.items():
        sent.clear()
        update, stats = _rounds(_fed(**options), dist.group.WORLD).run(0)
        results[name] = {"update": update, "dropped": stats.dropped, "sent": sent[0]}
    return results


@pytest.fixture(scope="module")
def dropped_round() -> list[dict]:
    """``_one_round_each`` on 2 ranks."""
    return run_on_ranks(_one_round_each, 2)


def _survivors_mean(fed: FederatedConfig, dropped: list[int]) -> torch.Tensor:
    """The sample-weighted mean update of round 0's reporting clients, client by client in one process."""
    rounds = _rounds(fed)
    start = flat([*state_tensors(rounds.net)[0], *state_tensors(rounds.net)[1]])
    survivors = [c for c in rounds.drawn(0) if c not in dropped]
    weights = [rounds.weight(c) for c in survivors]
    updates = [rounds.client_update(c, 0, start)[0].double() for c in survivors]
    return sum(w * u for w, u in zip(weights, updates, strict=True)) / sum(weights)


def test_a_round_with_30_percent_dropouts_is_the_mean_of_the_survivors(dropped_round):
    fed = _fed()
    for name in ("plain", "secure"):
        dropped = dropped_round[0][name]["dropped"]
        assert len(dropped) == 3 and dropped == dropped_round[1][name]["dropped"]
        expected = _survivors_mean(fed, dropped)
        for rank in dropped_round:
            assert torch.allclose(rank[name]["update"].double(), expected, rtol=0, atol=1e-6), name  # measured: 2e-8
    everyone = _survivors_mean(fed, [])
    # a difference asserted (a larger atol is the stricter bound): the dropped clients' share moves the mean by up
    # to 1.0e-2 (measured), 100x this atol; the parity above is 1e-6
    assert not torch.allclose(everyone, _survivors_mean(fed, dropped_round[0]["plain"]["dropped"]), atol=1e-4)


def test_what_leaves_a_client_is_masked_and_uncorrelated_with_its_update(monkeypatch):
    """Every masked input differs from the client's encoded update and its decoded values are uncorrelated with
    it; so is each rank's payload with the sum of its clients' true updates."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    original = secure.mask

    def recording(encoded, client, publics, secrets):
        masked = original(encoded, client, publics, secrets)
        seen.append((encoded, masked))
        return masked

    monkeypatch.setattr(secure, "mask", recording)
    update, stats = _rounds(_fed(secure_aggregation=True)).run(0)
    assert len(seen) == 7 and len(stats.dropped) == 3
    for encoded, masked in seen:
        true, sent = secure.decode(encoded), secure.decode(masked)
        assert not torch.equal(encoded, masked)
        # independent vectors of n values correlate by about 1/sqrt(n) (0.02 here): 4 standard deviations
        assert abs(float(torch.corrcoef(torch.stack([true, sent]))[0, 1])) < 4 / true.numel() ** 0.5
        assert sent.abs().median() > 1e3 * true.abs().max()  # spread over the whole ring, not near the update


def test_a_ranks_payload_under_secure_aggregation_is_uncorrelated_with_its_clients_sum(dropped_round):
    fed = _fed(secure_aggregation=True)
    rounds = _rounds(fed)
    start = flat([*state_tensors(rounds.net)[0], *state_tensors(rounds.net)[1]])
    dropped = dropped_round[1]["secure"]["dropped"]
    mine = [c for slot, c in enumerate(rounds.drawn(0)) if slot % 2 == 1 and c not in dropped]
    true = sum(torch.cat([rounds.client_update(c, 0, start)[0] * rounds.weight(c), torch.tensor([rounds.weight(c)])])
               for c in mine).double()
    sent = secure.decode(dropped_round[1]["secure"]["sent"])
    assert abs(float(torch.corrcoef(torch.stack([true, sent]))[0, 1])) < 4 / true.numel() ** 0.5
    plain_sent = dropped_round[1]["plain"]["sent"].double()
    assert torch.allclose(plain_sent, true, atol=1e-5)  # in the clear the same payload is the sum itself


@pytest.mark.parametrize("options, key", [
    ({"dropout": 1.0}, "federated.dropout"),
    ({"dropout": 0.95}, "federated.dropout"),  # all 10 drop
    ({"dropout": 0.5, "secure_aggregation": True}, "federated.dropout"),  # 5 of 10 left: no majority
    # 7 of 10 report: Krum withstands 2 attackers (7 > 6), not 3
    ({"dropout": 0.3, "aggregation": "krum", "assumed_attackers": 3}, "federated.assumed_attackers"),
])
def test_impossible_dropouts_are_one_line_errors(options, key):
    fed = FederatedConfig(clients=10, clients_per_round=10, **options)
    with pytest.raises(ConfigError) as caught:
        fed.validate()
    assert caught.value.key == key and "\n" not in str(caught.value)
