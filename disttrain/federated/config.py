"""Schema of the ``federated`` node: clients, rounds, local training, server strategy, partition, privacy."""

from __future__ import annotations

from dataclasses import dataclass, field

from disttrain import checks
from disttrain.errors import ConfigError
from disttrain.federated.attack import ATTACKS
from disttrain.federated.robust import KRUM_RULES, RULES, trimmed_count

STRATEGIES = ("fedavg", "fedprox", "fedadam", "fedyogi")
PARTITIONS = ("iid", "dirichlet", "shards")
WEIGHTINGS = ("auto", "samples", "uniform")
MODES = ("sync", "async")
DEFAULT_PROX_MU = 0.01
"""FedProx's proximal weight when none is given: the middle of the values its authors tried (0.001 to 1)."""


@dataclass
class ServerOptions:
    """The server's step on the aggregated update ``delta`` (the clients' weighted mean change).

    fedavg / fedprox: ``w += lr * delta``. fedadam / fedyogi (Reddi et al., 2021, as Flower computes them):
    moments of ``delta`` with ``beta1`` and ``beta2``, ``w += lr * m / (sqrt(v) + tau)``; FedAdam's ``lr`` is
    bias-corrected by the round number.
    """

    lr: float | None = None
    """Server learning rate; null: 1.0 for fedavg and fedprox (the new model is the clients' mean), 0.01 for
    fedadam and fedyogi (Flower's default)."""
    beta1: float = 0.9
    """First-moment decay of fedadam / fedyogi."""
    beta2: float = 0.99
    """Second-moment decay of fedadam / fedyogi."""
    tau: float = 1e-3
    """Adaptivity floor added to sqrt(v) by fedadam / fedyogi."""

    def resolved_lr(self, strategy: str) -> float:
        """The server learning rate of ``strategy``."""
        if self.lr is not None:
            return self.lr
        return 1.0 if strategy in ("fedavg", "fedprox") else 0.01


@dataclass
class PrivacyConfig:
    """Client-level differential privacy (DP-FedAvg, McMahan et al., 2018): each sampled client's update is
    clipped to L2 norm ``clip``, the uniform mean of the clipped updates gets Gaussian noise of standard
    deviation ``noise_multiplier * clip / clients_per_round``, and Opacus' RDP accountant tracks epsilon."""

    clip: float | None = None
    """Bound on each client's update norm; null: no clipping, no privacy."""
    noise_multiplier: float = 0.0
    """Noise standard deviation in units of the clipped sensitivity (needs ``clip``)."""
    delta: float = 1e-5
    """The delta at which epsilon is reported."""

    @property
    def enabled(self) -> bool:
        """Updates are clipped (and perhaps noised)."""
        return self.clip is not None


@dataclass
class AttackConfig:
    """Simulated hostile clients (``disttrain.federated.attack``): a seeded share of the clients send poisoned
    updates in every round they are drawn."""

    kind: str = "none"
    """none, sign_flip (send -scale x the honest update), scale (scale x it), random (Gaussian noise scale x
    the honest update's RMS) or label_flip (train on labels y -> classes - 1 - y)."""
    fraction: float = 0.0
    """Share of the clients that attack (round(fraction x clients) of them, drawn from the run's seed)."""
    scale: float = 10.0
    """Magnitude of sign_flip, scale and random updates."""

    @property
    def enabled(self) -> bool:
        """Some clients attack."""
        return self.kind != "none"


@dataclass
class FederatedConfig:
    """A federated run (``parallel=federated``): ``clients`` simulated clients spread over the ranks, each
    holding one partition of the training split; every round ``clients_per_round`` of them, drawn with the
    run's seed, train locally from the global model, and the server aggregates their updates."""

    clients: int = 0
    """Simulated clients (several per rank); 0: not a federated run."""
    clients_per_round: int = 0
    """Clients drawn each round (seeded, without replacement); 0: every client every round."""
    rounds: int = 30
    """Rounds of training (each one optimiser step of the global model: sets trainer.max_steps)."""
    local_steps: int = 10
    """Optimiser steps each client takes per round (when ``local_epochs`` is 0)."""
    local_epochs: int = 0
    """Passes over its own data each client makes per round; 0: ``local_steps`` steps instead."""
    batch_size: int = 32
    """Samples per local step of a client."""
    strategy: str = "fedavg"
    """fedavg, fedprox (local proximal term ``mu``), fedadam or fedyogi (adaptive server steps)."""
    mu: float | None = None
    """FedProx: weight of the proximal term ``mu / 2 * ||w - w_global||^2`` in each local step; positive with
    fedprox (0 would make it FedAvg), unset or 0 otherwise. null: ``DEFAULT_PROX_MU`` with fedprox, else 0."""
    server: ServerOptions = field(default_factory=ServerOptions)
    """The server's step on the aggregated update."""
    partition: str = "iid"
    """How the training split is divided: iid (a seeded shuffle cut into equal parts), dirichlet (each class
    spread over clients by Dirichlet(alpha) proportions) or shards (sorted by label, cut into
    ``clients * classes_per_client`` shards, each client takes ``classes_per_client``)."""
    alpha: float = 0.5
    """Dirichlet concentration: small is skewed (0.1: most clients see one or two classes), large is iid."""
    classes_per_client: int = 2
    """Shards per client with ``partition=shards``."""
    weighting: str = "auto"
    """Weights of client updates: samples (by their sample counts, FedAvg), uniform, or auto: samples, and
    uniform under differential privacy (whose noise is calibrated to one client's share of a uniform mean)."""
    dp: PrivacyConfig = field(default_factory=PrivacyConfig)
    """Client-level differential privacy."""
    secure_aggregation: bool = False
    """Clients add pairwise and self masks that cancel or are removed in the sum (Bonawitz et al., 2017, with
    dropout recovery from Shamir shares: needs ``pip install 'disttrain[federated]'``), so no rank sees a
    client's update in the clear."""
    dropout: float = 0.0
    """Share of each round's drawn clients that drop out mid-round (``round(dropout x drawn)``, chosen from the
    seed and the round): they never report and the round completes with the rest. Under secure aggregation
    at most a minority may drop (a majority's shares rebuild the dropped clients' masks)."""
    eval_batches: int = 4
    """Batches of its own data each sampled client evaluates the global model on (client accuracy)."""
    aggregation: str = "mean"
    """How the server combines the round's client updates before its optimiser steps: mean (weighted by
    ``weighting``), or a Byzantine-robust rule over unweighted updates: median (coordinate-wise),
    trimmed_mean (drops ``trim_fraction`` of the values at each end of every coordinate), krum (the single
    update closest to its neighbours) or multi_krum (the mean of the ``n - assumed_attackers`` closest)."""
    trim_fraction: float = 0.2
    """trimmed_mean: share of the reporting clients dropped at each end of every coordinate (below 0.5; to
    withstand f attackers among n it must be at least f / n)."""
    assumed_attackers: int | None = None
    """krum and multi_krum: the number f of hostile clients per round the rule must withstand; needs more
    than 2 f + 2 reporting clients per round. null: the largest f the round allows, ``(n - 3) // 2`` of n
    reporting clients (Krum guarantees nothing beyond its f, and f = 0 would make multi_krum the plain mean);
    the run names the f it took in one line at its start and in results.json. 0 withstands no attacker."""
    attack: AttackConfig = field(default_factory=AttackConfig)
    """Simulated hostile clients."""
    mode: str = "sync"
    """sync: rounds wait for every drawn client; async: buffered asynchronous aggregation (FedBuff, Nguyen et
    al. 2022): ``clients_per_round`` clients train concurrently, each from the model the server held when it
    started, and the server steps whenever ``buffer_size`` updates have arrived, each weighted by
    ``1 / sqrt(1 + staleness)`` (staleness: server steps since the client started). ``rounds`` counts server
    steps."""
    buffer_size: int = 0
    """async: updates per server step (K); 0: half of ``clients_per_round``."""
    slow_fraction: float = 0.0
    """Share of the clients (drawn from the seed) whose local training is ``slowdown`` times slower."""
    slowdown: float = 10.0
    """How many times slower the slow clients are."""
    latency_spread: float = 0.25
    """Each local training takes ``exp(latency_spread x z)`` simulated time units (``z`` standard normal, seeded),
    times ``slowdown`` for a slow client; a round of the synchronous mode lasts as long as its slowest client."""

    @property
    def enabled(self) -> bool:
        """This is a federated run."""
        return self.clients > 0

    @property
    def per_round(self) -> int:
        """Clients drawn each round."""
        return self.clients_per_round or self.clients

    @property
    def buffer(self) -> int:
        """Updates per server step in async mode."""
        return self.buffer_size or max(1, self.per_round // 2)

    @property
    def robust(self) -> bool:
        """A robust rule replaces the mean (the server needs every update on its own)."""
        return self.aggregation != "mean"

    @property
    def reporting(self) -> int:
        """Clients whose updates reach the server each round."""
        return self.per_round - round(self.dropout * self.per_round)

    @property
    def resolved_attackers(self) -> int:
        """krum / multi_krum's f: ``assumed_attackers``, or (null) the largest that the reporting clients
        outvote (``n > 2 f + 2``)."""
        if self.assumed_attackers is not None:
            return self.assumed_attackers
        return max(0, (self.reporting - 3) // 2)

    @property
    def resolved_weighting(self) -> str:
        """samples or uniform."""
        if self.weighting != "auto":
            return self.weighting
        return "uniform" if self.dp.enabled or self.robust else "samples"

    def validate(self) -> None:
        """Checks that need no data."""
        if self.clients < 0:
            raise ConfigError("federated.clients", self.clients, "a positive number of clients (0: not federated)")
        if not self.enabled:
            return
        if not 0 <= self.clients_per_round <= self.clients:
            raise ConfigError("federated.clients_per_round", self.clients_per_round,
                              f"between 1 and federated.clients={self.clients} (0: every client)")
        checks.positive("federated.rounds", self.rounds)
        checks.positive("federated.batch_size", self.batch_size)
        checks.positive("federated.eval_batches", self.eval_batches)
        checks.non_negative("federated.local_epochs", self.local_epochs)
        if self.local_epochs == 0:
            checks.positive("federated.local_steps", self.local_steps)
        for key, value, allowed in (("strategy", self.strategy, STRATEGIES), ("partition", self.partition, PARTITIONS),
                                    ("weighting", self.weighting, WEIGHTINGS), ("aggregation", self.aggregation, RULES),
                                    ("attack.kind", self.attack.kind, ATTACKS)):
            if value not in allowed:
                raise ConfigError(f"federated.{key}", value, f"one of {list(allowed)}")
        if self.mu is None:
            self.mu = DEFAULT_PROX_MU if self.strategy == "fedprox" else 0.0
        checks.non_negative("federated.mu", self.mu)
        if self.strategy == "fedprox" and not self.mu:
            raise ConfigError("federated.mu", self.mu, "a positive proximal weight with federated.strategy=fedprox "
                              f"(with 0 it is FedAvg: use strategy=fedavg; null takes {DEFAULT_PROX_MU})")
        if self.mu and self.strategy != "fedprox":
            raise ConfigError("federated.mu", self.mu, "0 unless federated.strategy=fedprox (mu is FedProx's "
                              f"proximal weight; strategy is {self.strategy})")
        if self.partition == "dirichlet" and not self.alpha > 0:
            raise ConfigError("federated.alpha", self.alpha, "a positive Dirichlet concentration")
        checks.positive("federated.classes_per_client", self.classes_per_client)
        checks.positive("federated.server.lr", self.server.lr, optional=True)
        checks.unit_interval("federated.server.beta1", self.server.beta1)
        checks.unit_interval("federated.server.beta2", self.server.beta2)
        checks.positive("federated.server.tau", self.server.tau)
        dp = self.dp
        checks.positive("federated.dp.clip", dp.clip, optional=True)
        checks.non_negative("federated.dp.noise_multiplier", dp.noise_multiplier)
        if dp.noise_multiplier and not dp.enabled:
            raise ConfigError("federated.dp.noise_multiplier", dp.noise_multiplier,
                              "0 unless federated.dp.clip is set (noise is calibrated to the clipped update norm)")
        if not 0 < dp.delta < 1:
            raise ConfigError("federated.dp.delta", dp.delta, "a probability strictly between 0 and 1")
        if dp.enabled and self.weighting == "samples":
            raise ConfigError("federated.weighting", self.weighting, "uniform or auto with federated.dp.clip set "
                              "(the privacy noise is calibrated to one client's share of a uniform mean)")
        self._validate_robustness()

    def _validate_speeds(self) -> None:
        """Client speeds and the asynchronous mode."""
        if self.mode not in MODES:
            raise ConfigError("federated.mode", self.mode, f"one of {list(MODES)}")
        checks.probability("federated.slow_fraction", self.slow_fraction)
        if not self.slowdown >= 1:
            raise ConfigError("federated.slowdown", self.slowdown, "a factor >= 1")
        checks.non_negative("federated.latency_spread", self.latency_spread)
        checks.non_negative("federated.buffer_size", self.buffer_size)
        if self.mode == "sync":
            return
        if not 1 <= self.buffer <= self.per_round:
            raise ConfigError("federated.buffer_size", self.buffer_size, f"between 1 and the {self.per_round} "
                              "clients training at once (federated.clients_per_round) with federated.mode=async")
        if self.per_round >= self.clients:
            raise ConfigError("federated.clients_per_round", self.clients_per_round, f"fewer than the {self.clients} "
                              "clients with federated.mode=async (a finished client's slot goes to an idle one)")
        for key, value, off in (("secure_aggregation", self.secure_aggregation, False), ("dropout", self.dropout, 0),
                                ("aggregation", self.aggregation, "mean"), ("dp.clip", self.dp.clip, None)):
            if value != off:
                raise ConfigError(f"federated.{key}", value, f"{off} with federated.mode=async (buffered "
                                  "aggregation here takes plain, always-reporting clients)")

    def _validate_robustness(self) -> None:
        """Robust rules and attacks: ranges, and the combinations that cannot work."""
        checks.probability("federated.dropout", self.dropout)
        if self.reporting < 1:
            raise ConfigError("federated.dropout", self.dropout, f"a share that leaves at least one of the "
                              f"{self.per_round} drawn clients reporting")
        if self.secure_aggregation and self.reporting < self.per_round // 2 + 1:
            raise ConfigError("federated.dropout", self.dropout, f"at most {(self.per_round - 1) // 2} dropped of "
                              f"{self.per_round} drawn clients with secure aggregation (the shares of a majority "
                              "rebuild the dropped clients' masks)")
        self._validate_speeds()
        attack, n = self.attack, self.reporting
        checks.probability("federated.attack.fraction", attack.fraction)
        checks.positive("federated.attack.scale", attack.scale)
        if attack.enabled and round(attack.fraction * self.clients) == 0:
            raise ConfigError("federated.attack.fraction", attack.fraction, f"a share that makes at least one of "
                              f"the {self.clients} clients hostile with federated.attack.kind={attack.kind}")
        if not attack.enabled and attack.fraction:
            raise ConfigError("federated.attack.fraction", attack.fraction,
                              "0 with federated.attack.kind=none (name the attack: one of "
                              f"{[a for a in ATTACKS if a != 'none']})")
        if not 0 <= self.trim_fraction < 0.5:
            raise ConfigError("federated.trim_fraction", self.trim_fraction, "a share in [0, 0.5)")
        if self.assumed_attackers is not None:
            checks.non_negative("federated.assumed_attackers", self.assumed_attackers)
        if not self.robust:
            return
        if self.secure_aggregation:
            raise ConfigError("federated.aggregation", self.aggregation, "mean with federated.secure_aggregation="
                              "true (the server sees only the masked sum, never the single updates a robust rule "
                              "compares)")
        if self.dp.noise_multiplier:
            raise ConfigError("federated.aggregation", self.aggregation, "mean with federated.dp.noise_multiplier "
                              "set (the noise is calibrated to the sensitivity of a mean)")
        if self.weighting == "samples":
            raise ConfigError("federated.weighting", self.weighting, f"uniform or auto with federated.aggregation="
                              f"{self.aggregation} (robust rules weigh clients alike: a reported sample count is "
                              "as forgeable as an update)")
        if self.aggregation == "trimmed_mean" and 2 * trimmed_count(n, self.trim_fraction) >= n:
            raise ConfigError("federated.trim_fraction", self.trim_fraction,
                              f"a share that leaves values after trimming {n} reporting clients at both ends")
        if self.aggregation not in KRUM_RULES:
            return
        if n < 3:
            raise ConfigError("federated.clients_per_round", self.clients_per_round, f"a count that leaves at least "
                              f"3 reporting clients per round with federated.aggregation={self.aggregation} (there "
                              f"are {n}; Krum needs n > 2f + 2 even for f = 0)")
        if not n > 2 * self.resolved_attackers + 2:
            raise ConfigError("federated.assumed_attackers", self.assumed_attackers,
                              f"at most {(n - 3) // 2} with federated.aggregation={self.aggregation} and {n} "
                              "reporting clients per round (Krum needs n > 2f + 2; null takes that most)")
