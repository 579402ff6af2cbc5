"""Checks of a federated run against the layout and the data, before any rank starts."""

from __future__ import annotations

from typing import Any

from disttrain.errors import ConfigError
from disttrain.federated.partition import empty_clients, labels_of
from disttrain.federated.robust import KRUM_RULES
from disttrain.parallel.layout import ZERO_FIELD, Layout


def krum_f(fed: Any) -> str:
    """`` (f=N)`` after a Krum rule's name in the run's first line; nothing for the other rules."""
    return f" (f={fed.resolved_attackers})" if fed.aggregation in KRUM_RULES else ""


def default_attackers_notice(fed: Any) -> str:
    """The line that says which f a Krum rule took when ``federated.assumed_attackers`` is null."""
    f, n = fed.resolved_attackers, fed.reporting
    return (f"federated.assumed_attackers=null: {fed.aggregation} assumes f={f} hostile clients per round, the "
            f"most that {n} reporting clients outvote (n > 2f + 2); set it to the number you expect")


def check_federated(top: Any, layout: Layout, datamodule: Any) -> list[str]:
    """Refuse impossible federated settings; set ``trainer.max_steps`` to the rounds; notices for the user."""
    from disttrain.federated.partition import client_partitions

    fed, p = top.federated, top.parallel
    fed.validate()
    if not fed.enabled:
        if p.federated:
            raise ConfigError("federated.clients", fed.clients, "a positive number of clients with parallel=federated")
        return []
    if not p.federated:
        raise ConfigError("federated.clients", fed.clients, f"0 unless parallel=federated (parallel is {p.name})")
    if layout.dp_replicate != layout.world_size or layout.shards_optimizer_state or p.sync_every or p.servers:
        raise ConfigError("parallel.dp_replicate", p.dp_replicate, f"-1 with parallel=federated, and no {ZERO_FIELD}, "
                          "sync_every, servers, tp or pp: every rank simulates clients on the whole model")
    if top.comm.name != "none":
        raise ConfigError("comm.name", top.comm.name, "none with parallel=federated (client updates travel whole)")
    if top.trainer.precision not in ("32-true", "32"):
        raise ConfigError("trainer.precision", top.trainer.precision, "32-true with parallel=federated")
    if top.trainer.max_steps not in (-1, fed.rounds):
        raise ConfigError("trainer.max_steps", top.trainer.max_steps,
                          f"-1 with parallel=federated (federated.rounds={fed.rounds} sets the length)")
    top.trainer.max_steps = fed.rounds
    if fed.dp.noise_multiplier:
        try:
            import opacus  # noqa: F401
        except ImportError:
            raise ConfigError("federated.dp.noise_multiplier", fed.dp.noise_multiplier,
                              "0 unless Opacus is installed (pip install 'disttrain[federated]'): its accountant "
                              "reports the privacy spent") from None
    if fed.secure_aggregation:
        try:
            import Crypto.Protocol.SecretSharing  # noqa: F401
            import cryptography.hazmat.primitives.asymmetric.x25519  # noqa: F401
        except ImportError:
            raise ConfigError("federated.secure_aggregation", True, "false unless cryptography and pycryptodome "
                              "are installed (pip install 'disttrain[federated]'): key agreement and Shamir "
                              "shares") from None
    train_set = datamodule.datasets["train"]
    if fed.attack.kind == "label_flip" and labels_of(train_set) is None:
        raise ConfigError("federated.attack.kind", fed.attack.kind, "sign_flip, scale or random for data without "
                          "one class label per sample (label_flip maps class labels)")
    if len(train_set) < fed.clients:
        raise ConfigError("federated.clients", fed.clients, f"at most the {len(train_set)} training samples")
    parts, _ = client_partitions(fed, train_set, top.seed)
    empty = empty_clients(parts)
    eligible = fed.clients - len(empty)
    if fed.per_round > eligible:
        raise ConfigError("federated.clients_per_round", fed.clients_per_round,
                          f"at most the {eligible} clients that hold samples ({len(empty)} of {fed.clients} are empty "
                          f"under partition={fed.partition})")
    held = parts.sizes()
    sizes = held[held > 0].tolist()
    local = f"{fed.local_epochs} local epochs" if fed.local_epochs else f"{fed.local_steps} local steps"
    notices = [f"federated: {fed.clients} clients ({fed.partition}, {min(sizes)}-{max(sizes)} samples each), "
               f"{fed.per_round} per round, {fed.rounds} rounds of {local}, {fed.strategy}, "
               f"aggregation={fed.aggregation}{krum_f(fed)}"]
    extras = []
    if fed.mode == "async":
        extras.append(f"asynchronous (FedBuff): {fed.per_round} training at once, a server step per {fed.buffer} "
                      "updates")
    if fed.slow_fraction:
        extras.append(f"{round(fed.slow_fraction * fed.clients)} clients {fed.slowdown:g}x slower")
    if fed.dropout:
        extras.append(f"{round(fed.dropout * fed.per_round)} of {fed.per_round} drop out each round")
    if fed.attack.enabled:
        extras.append(f"{round(fed.attack.fraction * fed.clients)} clients attack ({fed.attack.kind})")
    if extras:
        notices[0] += "; " + "; ".join(extras)
    if fed.aggregation in KRUM_RULES and fed.assumed_attackers is None:
        notices.append(default_attackers_notice(fed))
    if empty:
        named = f"{empty}" if len(empty) <= 20 else f"{empty[:20]} and {len(empty) - 20} more"
        notices.append(f"federated.partition={fed.partition}: clients {named} hold no samples and are never drawn")
    return notices
