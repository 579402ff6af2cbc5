"""Secure aggregation with dropout recovery (Bonawitz et al., 2017, the protocol SecAgg+ runs).

Setup of a round: every drawn client ``u`` holds an X25519 key pair and a 16-byte self-mask seed ``b_u``,
and Shamir-shares its secret key and ``b_u`` among the drawn clients with threshold ``t`` (a majority).
Two clients' pair seed is their X25519 shared secret, which either side derives from its own secret key
and the other's public key. A client encodes its update in fixed point modulo 2^48 and sends
``y_u = x_u + PRG(b_u) + sum_{v > u} PRG(s_uv) - sum_{v < u} PRG(s_uv)``: uniform noise on its own.

Unmasking: the server sums the survivors' ``y_u``. Pair masks between two survivors cancel in the sum. From
``t`` shares held by survivors it rebuilds every survivor's ``b_u`` (removing the self masks) and every
dropped client's secret key (removing the masks survivors added with it); never both for one client, so
no single update is ever revealed, even of a client that was declared dropped and reports late.

In this simulation every secret is drawn from the run's seed, the round and the client (a deployment draws
them from ``os.urandom``), so a resumed run masks the same way, and the shares a client would send to its
peers (encrypted, through the server) are computed where they are used.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from disttrain.counter_random import counter_random

MODULUS_BITS = 48
MODULUS = 1 << MODULUS_BITS
FRACTION_BITS = 24
"""Fixed point: values are multiples of 2^-24 (6e-8) with magnitude below 2^23."""
_SECRET_TAG = 0x5EC0
_SEED_BITS = (1 << 63) - 1
_HALF = 16  # pycryptodome's Shamir shares 16-byte secrets: a 32-byte key travels as two halves


def encode(values: torch.Tensor) -> torch.Tensor:
    """``values`` as fixed-point residues in [0, 2^48) (int64)."""
    scaled = torch.round(values.detach().double() * (1 << FRACTION_BITS))
    limit = 1 << (MODULUS_BITS - 2)
    if scaled.abs().max() >= limit:
        raise RuntimeError(f"secure aggregation: an update value of magnitude {float(values.abs().max()):.3g} is "
                           f"beyond the fixed-point range (below 2^{MODULUS_BITS - 2 - FRACTION_BITS})")
    return torch.remainder(scaled.long(), MODULUS)


def decode(residues: torch.Tensor) -> torch.Tensor:
    """The signed values (float64) of a sum of encoded residues."""
    reduced = torch.remainder(residues, MODULUS)
    signed = torch.where(reduced >= MODULUS // 2, reduced - MODULUS, reduced)
    return signed.double() / (1 << FRACTION_BITS)


def threshold(participants: int) -> int:
    """Shares needed to rebuild a secret: a majority of the round's clients, so no minority can unmask."""
    return participants // 2 + 1


@dataclass(frozen=True)
class Secrets:
    """One client's secrets of one round."""

    key: bytes
    """X25519 secret key (32 bytes)."""
    self_seed: bytes
    """Seed of the client's own mask (16 bytes)."""


def _derived_bytes(seed: int, round_index: int, client: int, purpose: int, size: int) -> bytes:
    value = counter_random(seed ^ _SECRET_TAG, round_index, client * 4 + purpose)
    return hashlib.sha256(value.to_bytes(8, "little") + bytes([purpose])).digest()[:size]


def client_secrets(seed: int, round_index: int, client: int) -> Secrets:
    """Client ``client``'s secrets in round ``round_index`` (seeded: see the module's note)."""
    return Secrets(_derived_bytes(seed, round_index, client, 1, 32), _derived_bytes(seed, round_index, client, 2, 16))


def public_key(secret_key: bytes) -> bytes:
    """The X25519 public key of ``secret_key``."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

    return X25519PrivateKey.from_private_bytes(secret_key).public_key().public_bytes_raw()


def pair_seed(secret_key: bytes, peer_public: bytes) -> int:
    """The seed two clients share: a hash of their X25519 shared secret (the same from either side)."""
    from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey

    shared = X25519PrivateKey.from_private_bytes(secret_key).exchange(X25519PublicKey.from_public_bytes(peer_public))
    return int.from_bytes(hashlib.sha256(shared).digest()[:8], "little") & _SEED_BITS


def expand(seed: int, numel: int) -> torch.Tensor:
    """The mask of ``seed``: ``numel`` uniform residues."""
    return torch.randint(0, MODULUS, (numel,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64)


def _self_seed(secret: bytes) -> int:
    return int.from_bytes(hashlib.sha256(secret).digest()[:8], "little") & _SEED_BITS


def mask(encoded: torch.Tensor, client: int, publics: dict[int, bytes], secrets: Secrets) -> torch.Tensor:
    """``encoded`` (on the CPU) plus the client's self mask and its pair masks with every other client whose
    public key is in ``publics``, modulo 2^48."""
    masked = encoded + expand(_self_seed(secrets.self_seed), encoded.numel())
    for other, public in publics.items():
        if other == client:
            continue
        shared = expand(pair_seed(secrets.key, public), encoded.numel())
        masked = masked + shared if client < other else masked - shared
    return torch.remainder(masked, MODULUS)


def split(secret: bytes, needed: int, holders: int) -> list[list[tuple[int, bytes]]]:
    """Shamir shares of ``secret`` (16 or 32 bytes) for ``holders`` clients, any ``needed`` of which rebuild it:
    holder ``i`` gets one ``(index, share)`` per 16-byte half."""
    from Crypto.Protocol.SecretSharing import Shamir

    halves = [Shamir.split(needed, holders, secret[i:i + _HALF]) for i in range(0, len(secret), _HALF)]
    return [[half[holder] for half in halves] for holder in range(holders)]


def combine(shares: list[list[tuple[int, bytes]]]) -> bytes:
    """The secret rebuilt from its holders' shares (each holder's list as ``split`` gave it)."""
    from Crypto.Protocol.SecretSharing import Shamir

    return b"".join(Shamir.combine([held[half] for held in shares]) for half in range(len(shares[0])))


def unmask(total: torch.Tensor, participants: list[int], survivors: list[int], seed: int,
           round_index: int) -> torch.Tensor:
    """The plain sum of the survivors' inputs from the sum ``total`` of their masked inputs: the masks of
    each survivor and those shared with each dropped client are rebuilt from shares that ``threshold`` of the
    survivors hand over."""
    needed = threshold(len(participants))
    if len(survivors) < needed:
        raise RuntimeError(f"secure aggregation: {len(survivors)} of {len(participants)} clients reported, fewer "
                           f"than the {needed} whose shares rebuild the dropped clients' masks")
    slot = {client: i for i, client in enumerate(participants)}
    helpers = [slot[client] for client in survivors[:needed]]
    secrets = {client: client_secrets(seed, round_index, client) for client in participants}
    publics = {client: public_key(secrets[client].key) for client in participants}
    numel = total.numel()
    result = total.clone()
    alive = set(survivors)
    for client in participants:
        # the client split its secret among all participants; the server collects the helpers' shares only
        if client in alive:
            held = split(secrets[client].self_seed, needed, len(participants))
            self_seed = combine([held[i] for i in helpers])
            result = result - expand(_self_seed(self_seed), numel)
            continue
        held = split(secrets[client].key, needed, len(participants))
        key = combine([held[i] for i in helpers])
        for survivor in survivors:
            shared = expand(pair_seed(key, publics[survivor]), numel)
            # survivor added the mask if it had the lower id, else subtracted it: undo that
            result = result - shared if survivor < client else result + shared
    return torch.remainder(result, MODULUS)
