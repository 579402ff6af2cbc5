"""Federated learning: partitions, the server's rules against Flower, aggregation over ranks against the
sample-weighted mean, FedProx, secure aggregation, privacy, what crosses ranks and config errors (whole runs
through the runner: test_federated_runs.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn

from disttrain.data.digits import DigitsConfig, ImageDataset, digits_split
from disttrain.errors import ConfigError
from disttrain.federated import privacy, secure
from disttrain.federated.config import FederatedConfig, PrivacyConfig
from disttrain.federated.partition import labels_of, partition
from disttrain.federated.rounds import METRIC_COLUMNS, FederatedRounds, flat, state_tensors
from disttrain.federated.server import ServerOptimizer
from disttrain.optim.torch_optims import SGDConfig
from tests.dist_utils import run_on_ranks

CLIP = 0.5  # binds: digits gradients of this model have norms of 1-3 in the first rounds


def _digits() -> ImageDataset:
    return ImageDataset(*digits_split(DigitsConfig())["train"])


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))


def _rounds(fed: FederatedConfig, group=None, net=None, seed=0) -> FederatedRounds:
    dataset = _digits()
    parts = partition(len(dataset), fed.clients, fed.partition, seed, labels_of(dataset), fed.alpha)
    return FederatedRounds(net or _net(), dataset, parts, fed, SGDConfig(lr=0.1, momentum=0.0, weight_decay=1e-3),
                           CLIP, seed, group, torch.device("cpu"))


def _fed(**options) -> FederatedConfig:
    fed = FederatedConfig(clients=6, clients_per_round=4, local_steps=3, batch_size=16, partition="dirichlet",
                          alpha=0.3)
    for key, value in options.items():
        setattr(fed, key, value)
    if fed.strategy != "fedprox" or fed.mu:  # FedProx with mu 0 is refused in a config; here it shows it is FedAvg
        fed.validate()
    return fed


# ---- partitions ---------------------------------------------------------------------------------------------


def test_iid_partition_is_the_first_epoch_of_a_distributed_sampler():
    from torch.utils.data import DistributedSampler

    dataset = _digits()
    parts = partition(len(dataset), 4, "iid", seed=3)
    for rank, part in enumerate(parts):
        sampler = DistributedSampler(dataset, num_replicas=4, rank=rank, shuffle=True, seed=3, drop_last=True)
        assert part[:len(sampler)].tolist() == list(sampler)


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "shards"])
def test_every_sample_belongs_to_exactly_one_client(scheme):
    dataset = _digits()
    parts = partition(len(dataset), 10, scheme, seed=1, labels=labels_of(dataset), alpha=0.5, classes_per_client=2)
    assert sorted(torch.cat(list(parts)).tolist()) == list(range(len(dataset)))
    if scheme == "shards":  # two shards of a label-sorted split: at most a few classes per client
        assert max(len(torch.unique(dataset.labels[p])) for p in parts) <= 4


def test_a_small_dirichlet_alpha_skews_the_labels():
    dataset = _digits()
    labels = labels_of(dataset)

    def mean_classes(alpha):
        parts = partition(len(dataset), 20, "dirichlet", 0, labels, alpha)
        return np.mean([len(torch.unique(labels[p])) for p in parts if len(p)])

    assert mean_classes(0.1) < 5 < 9.5 < mean_classes(100.0)  # measured: 4.2 and 10.0


# ---- the server's rules against Flower ----------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["FedAvg", "FedAdam", "FedYogi"])
def test_server_rules_equal_flowers_strategies(strategy):
    flwr = pytest.importorskip("flwr")
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server import strategy as strategies

    generator = torch.Generator().manual_seed(0)
    shapes = [(5, 3), (3,)]
    start = [torch.randn(shape, generator=generator) for shape in shapes]
    options = {} if strategy == "FedAvg" else {"eta": 0.03, "eta_l": 0.1, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}
    theirs = getattr(strategies, strategy)(initial_parameters=ndarrays_to_parameters([t.numpy() for t in start]),
                                           **options)
    ours = [nn.Parameter(t.clone()) for t in start]
    rule = {"FedAvg": "avg", "FedAdam": "adam", "FedYogi": "yogi"}[strategy]
    optimizer = ServerOptimizer(ours, rule, 1.0 if rule == "avg" else 0.03, 0.9, 0.99, 1e-3)
    del flwr
    for server_round in (1, 2, 3):
        counts = [7, 19, 30]
        clients = [[p.detach() + 0.1 * torch.randn(p.shape, generator=generator) for p in ours] for _ in counts]
        results = [(None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters([t.numpy() for t in weights]), n, {}))
                   for weights, n in zip(clients, counts, strict=True)]
        aggregated, _ = theirs.aggregate_fit(server_round, results, [])
        for i, param in enumerate(ours):
            mean = sum(n * c[i] for c, n in zip(clients, counts, strict=True)) / sum(counts)
            param.grad = -(mean - param.detach())
        optimizer.step()
        for mine, expected in zip(ours, parameters_to_ndarrays(aggregated), strict=True):
            assert np.allclose(mine.detach().numpy(), expected, rtol=1e-5, atol=1e-6), (strategy, server_round)


def test_flower_fedprox_with_mu_zero_is_fedavg_on_the_server():
    """On the server FedProx is FedAvg (mu acts in the clients' local steps)."""
    pytest.importorskip("flwr")
    from flwr.server.strategy import FedProx

    assert FedProx(proximal_mu=0.0).aggregate_fit.__qualname__.startswith("FedAvg")


# ---- rounds over ranks --------------------------------------------------------------------------------------


SETTINGS = {
    "plain": {}, "secure": {"secure_aggregation": True},
    "prox0": {"strategy": "fedprox", "mu": 0.0}, "prox5": {"strategy": "fedprox", "mu": 5.0},
    "dp_unbound": {"dp": PrivacyConfig(clip=1e9, noise_multiplier=0.0)}, "uniform": {"weighting": "uniform"},
    "dp_clipped": {"dp": PrivacyConfig(clip=0.05, noise_multiplier=0.0)},
    "dp_noisy": {"dp": PrivacyConfig(clip=0.05, noise_multiplier=1.0)},
}


def _two_rounds_each() -> dict[str, dict]:
    """Two rounds over the ranks under every setting: the global model after each, and every payload that
    crossed ranks (one spawn of the ranks for all settings)."""
    sent: list[tuple[str, tuple, torch.dtype, torch.Tensor]] = []
    originals = {name: getattr(dist, name) for name in ("all_reduce", "broadcast", "all_gather", "send", "isend",
                                                         "reduce", "gather", "scatter", "all_to_all_single")}

    def wrapped(name):
        def call(tensor, *args, **kwargs):
            if isinstance(tensor, torch.Tensor):
                sent.append((name, tuple(tensor.shape), tensor.dtype, tensor.detach().clone()))
            return originals[name](tensor, *args, **kwargs)
        return call

    for name in originals:
        setattr(dist, name, wrapped(name))
    results = {}
    for setting, options in SETTINGS.items():
        sent.clear()
        rounds = _rounds(_fed(**options), dist.group.WORLD)
        server = ServerOptimizer([p for p in rounds.net.parameters()], "avg", 1.0)
        states, stats = [], []
        for r in range(2):
            update, round_stats = rounds.run(r)
            rounds.apply(update, server)
            server.step()
            states.append(flat([*state_tensors(rounds.net)[0], *state_tensors(rounds.net)[1]]))
            stats.append(round_stats)
        results[setting] = {"states": states, "stats": stats, "sent": list(sent), "numel": states[0].numel()}
    return results


@pytest.fixture(scope="module")
def ranked() -> dict[str, list[dict]]:
    """``{setting: [rank 0's result, rank 1's result]}`` of ``_two_rounds_each`` on 2 ranks."""
    by_rank = run_on_ranks(_two_rounds_each, 2)
    return {setting: [rank[setting] for rank in by_rank] for setting in SETTINGS}


def _simulated(options: dict) -> list[torch.Tensor]:
    """The same two rounds in one process, client by client: the weighted mean of the client models."""
    fed = _fed(**options)
    rounds = _rounds(fed)
    params, buffers = state_tensors(rounds.net)
    states = []
    for r in range(2):
        start = flat([*params, *buffers])
        models, weights = [], []
        for client in rounds.drawn(r):
            update, _ = rounds.client_update(client, r, start)
            if fed.dp.enabled:
                update, _ = privacy.clip_update(update, fed.dp.clip)
            models.append(start + update)
            weights.append(len(rounds.data[client]) if fed.resolved_weighting == "samples" else 1.0)
        mean = sum(w * m.double() for w, m in zip(weights, models, strict=True)) / sum(weights)
        offset = 0
        with torch.no_grad():
            for tensor in [*params, *buffers]:
                tensor.copy_(mean[offset:offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
        states.append(flat([*params, *buffers]))
    return states


def test_the_aggregate_is_the_sample_weighted_mean_of_non_iid_client_models(ranked):
    by_rank = ranked["plain"]
    expected = _simulated({})
    sizes = {len(p) for p in _rounds(_fed()).data}
    assert len(sizes) > 3  # Dirichlet clients of different sizes: a uniform mean would differ
    for rank_result in by_rank:
        for ours, theirs in zip(rank_result["states"], expected, strict=True):
            assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-6)  # measured: 1.2e-7
    assert torch.equal(by_rank[0]["states"][1], by_rank[1]["states"][1])  # one global model on every rank


def test_only_model_shaped_updates_and_client_metrics_cross_ranks(ranked):
    result = ranked["secure"][0]
    numel, drawn = result["numel"], _fed().per_round
    data = _digits().images.reshape(len(_digits()), -1)
    for name, shape, dtype, payload in result["sent"]:
        assert name == "all_reduce"
        # one update vector (and its weight), one row of metrics per client
        assert shape in ((numel + 1,), (drawn, METRIC_COLUMNS)), shape
        if shape == (numel + 1,):
            assert dtype == torch.int64  # masked residues
        values = payload.reshape(-1).float()
        for row in data[:50]:  # no image travels, whole or as a prefix
            assert not torch.equal(values[:64], row)


def test_secure_aggregation_equals_the_plain_sum_and_hides_each_update(ranked):
    plain = ranked["plain"][0]
    masked = ranked["secure"]
    for ours, theirs in zip(masked[0]["states"], plain["states"], strict=True):
        assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    # what rank 1 sent in round 0: the sum of its clients' masked updates; decoded alone it is noise
    numel = masked[1]["numel"]
    sent = next(p for name, shape, _, p in masked[1]["sent"] if shape == (numel + 1,))
    alone = secure.decode(sent)
    rounds = _rounds(_fed())
    start = flat([*state_tensors(rounds.net)[0], *state_tensors(rounds.net)[1]])
    clients = rounds.drawn(0)[1::2]
    true = sum(torch.cat([rounds.client_update(c, 0, start)[0] * rounds.weight(c), torch.tensor([rounds.weight(c)])])
               for c in clients).double()
    assert (alone - true).abs().median() > 1e3 * true.abs().max()


def test_secure_masks_are_removed_exactly_with_and_without_dropouts():
    values = {c: torch.randn(100, generator=torch.Generator().manual_seed(c)) for c in (2, 5, 7, 11, 12)}
    participants = sorted(values)
    secrets = {c: secure.client_secrets(9, 3, c) for c in participants}
    publics = {c: secure.public_key(secrets[c].key) for c in participants}
    masked = {c: secure.mask(secure.encode(v), c, publics, secrets[c]) for c, v in values.items()}
    for survivors in (participants, [2, 7, 12]):  # everyone, then two dropped after the setup
        total = torch.remainder(sum(masked[c] for c in survivors), secure.MODULUS)
        assert not torch.allclose(secure.decode(total), sum(values[c].double() for c in survivors), atol=1.0)
        plain = secure.decode(secure.unmask(total, participants, survivors, seed=9, round_index=3))
        assert torch.allclose(plain, sum(values[c].double() for c in survivors), atol=5 * 2.0 ** -24)
    with pytest.raises(RuntimeError, match="fewer than the 3"):  # a majority must report
        secure.unmask(masked[2], participants, [2, 5], seed=9, round_index=3)


def test_shamir_shares_rebuild_a_secret_from_a_threshold_and_not_from_fewer():
    secret = secure.client_secrets(0, 0, 1).key
    shares = secure.split(secret, 3, 5)
    assert secure.combine([shares[4], shares[0], shares[2]]) == secret
    assert secure.combine(shares[:2]) != secret


def test_fedprox_with_mu_zero_is_fedavg_and_a_positive_mu_pulls_clients_back(ranked):
    avg, prox0, prox = (ranked[setting][0]["states"][1] for setting in ("plain", "prox0", "prox5"))
    assert torch.equal(prox0, avg)
    params = flat(state_tensors(_net())[0])  # the proximal term acts on parameters (buffers are statistics)
    moved, pulled = (avg[:params.numel()] - params).norm(), (prox[:params.numel()] - params).norm()
    assert pulled < 0.95 * moved, (pulled, moved)  # measured: 0.93 (clipped steps leave little to pull back)


# ---- privacy ------------------------------------------------------------------------------------------------


def test_clipped_updates_never_exceed_the_bound():
    generator = torch.Generator().manual_seed(0)
    for scale in (1e-3, 0.3, 1.0, 7.0, 1e4):
        clipped, norm = privacy.clip_update(torch.randn(1000, generator=generator) * scale, 0.8)
        assert float(torch.linalg.vector_norm(clipped, dtype=torch.float64)) <= 0.8
        assert (clipped == 0).sum() == 0 and norm > 0


def test_epsilon_is_the_accountants_for_the_same_rate_noise_and_rounds():
    pytest.importorskip("opacus")
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    for _ in range(25):
        accountant.step(noise_multiplier=1.1, sample_rate=0.25)
    assert privacy.epsilon(1.1, 0.25, 25, 1e-5) == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-12)
    assert privacy.epsilon(0.0, 0.25, 25, 1e-5) == float("inf")


def test_private_rounds_clip_each_update_and_noise_zero_is_the_non_private_run(ranked):
    private, uniform = ranked["dp_unbound"][0], ranked["uniform"][0]
    for ours, theirs in zip(private["states"], uniform["states"], strict=True):
        assert torch.equal(ours, theirs)
    clipped = ranked["dp_clipped"]
    norms = [n for rank in clipped for s in rank["stats"] for n in s.update_norms]
    assert min(norms) > 0.05  # the bound binds on every client
    expected = _simulated(SETTINGS["dp_clipped"])
    for ours, theirs in zip(clipped[0]["states"], expected, strict=True):
        assert torch.allclose(ours, theirs, rtol=1e-6, atol=1e-6)
    # the same clipped round plus exactly the round's noise, of std noise_multiplier x clip / clients per round
    noisy, fed = ranked["dp_noisy"][0], _fed(**SETTINGS["dp_noisy"])
    noise = privacy.gaussian_noise(noisy["numel"], 1.0 * 0.05 / fed.per_round, seed=0, round_index=0).float()
    assert noise.std() > 1e-2
    assert torch.allclose(noisy["states"][0] - clipped[0]["states"][0], noise, rtol=0, atol=1e-6)


# ---- configuration ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, key", [
    (["federated.clients_per_round=30"], "federated.clients_per_round"),
    (["federated.clients=5000"], "federated.clients"),
    (["federated.partition=dirichlet", "federated.alpha=0"], "federated.alpha"),
    (["federated.dp.noise_multiplier=1.0"], "federated.dp.noise_multiplier"),
    (["federated.mu=0.1"], "federated.mu"),
    (["federated.strategy=fedprox", "federated.mu=0.0"], "federated.mu"),  # FedAvg under another name
    (["federated.dp.clip=1", "federated.weighting=samples"], "federated.weighting"),
    (["federated.strategy=fedsgd"], "federated.strategy"),
    (["comm=fp16"], "comm.name"),
    (["trainer.max_steps=7"], "trainer.max_steps"),
])
def test_impossible_federated_settings_are_one_line_errors(make_config, overrides, key):
    from disttrain.config import validate

    with pytest.raises(ConfigError) as caught:
        validate(make_config(["parallel=federated", "trainer.devices=2", *overrides]))
    assert caught.value.key == key
    assert "\n" not in str(caught.value)


def test_fedprox_without_a_weight_takes_the_default_and_says_so_in_the_config(make_config):
    from disttrain.config import validate
    from disttrain.federated.config import DEFAULT_PROX_MU

    prox = validate(make_config(["parallel=federated", "trainer.devices=1", "federated.strategy=fedprox"]))
    avg = validate(make_config(["parallel=federated", "trainer.devices=1"]))
    assert (prox.train.federated.mu, avg.train.federated.mu) == (DEFAULT_PROX_MU, 0.0)
    assert f"mu: {DEFAULT_PROX_MU}" in prox.yaml


def test_clients_left_empty_by_a_skewed_split_are_reported(make_config):
    from disttrain.config import validate

    run = validate(make_config(["parallel=federated", "trainer.devices=1", "federated.clients=300",
                                "federated.partition=shards", "federated.classes_per_client=1",
                                "federated.clients_per_round=10"]))
    assert not any("hold no samples" in n for n in run.notices)
    run = validate(make_config(["parallel=federated", "trainer.devices=1", "federated.clients=200",
                                "federated.partition=dirichlet", "federated.alpha=0.01",
                                "federated.clients_per_round=10"]))
    assert any("hold no samples and are never drawn" in n for n in run.notices), run.notices
