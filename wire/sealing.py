"""Secrets sealed to one node's key: the construction, and the node's key pair.

A node's agent holds an X25519 key pair (`NodeKey`, generated once in its data directory, mode
0600) and sends the public half in `Register.sealing_key`. The controller seals the values of a
StartReplica's `secret:` references to that key, each message with a key pair of its own:

    e, E       = a fresh X25519 key pair (the sender's; e is used once and dropped)
    shared     = X25519(e, N)                       N: the node's public key
    key        = HKDF-SHA256(ikm=shared, salt=E || N, info="gpumesh secrets v1", 32 bytes)
    ciphertext = ChaCha20-Poly1305(key).encrypt(nonce=12 zero bytes, JSON {name: value}, aad)
    aad        = "gpumesh secrets v1|<node id>|<replica id>@<epoch>"

The nonce may be constant because every key is used for one message only (e is fresh each
time). The associated data binds a box to its node, replica and epoch: moved into another
command it does not open. Only the holder of the node's private key opens it; the controller
keeps no key of its own to open it again (its values are in its secret store). This is the
construction of libsodium's sealed boxes and of HPKE's base mode, with the `cryptography`
package's primitives.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Callable
from pathlib import Path

import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from events.contract.messages import SealedSecrets

from .errors import WireError

INFO = b"gpumesh secrets v1"
_NONCE = bytes(12)
_RAW = serialization.Encoding.Raw
_PUBLIC_RAW = serialization.PublicFormat.Raw
_VALUES = msgspec.json.Decoder(dict[str, str])

# Makes the sender's one-time key; the default draws from the OS (X25519PrivateKey.generate).
# The simulator and tests pass a deterministic one.
EphemeralSource = Callable[[], X25519PrivateKey]


class SealingError(WireError):
    """A sealed box that does not open (another node's, altered, or a bad key)."""


def aad(node_id: str, replica_id: str, epoch: int) -> bytes:
    return b"|".join([INFO, node_id.encode(), f"{replica_id}@{epoch}".encode()])


def public_text(key: X25519PublicKey) -> str:
    return base64.b64encode(key.public_bytes(_RAW, _PUBLIC_RAW)).decode()


def _public(text: str) -> X25519PublicKey:
    try:
        raw = base64.b64decode(text, validate=True)
        return X25519PublicKey.from_public_bytes(raw)
    except ValueError as exc:
        raise SealingError(f"not an X25519 public key: {exc}") from None


def _key(shared: bytes, sender: bytes, recipient: bytes) -> bytes:
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=sender + recipient, info=INFO)
    return hkdf.derive(shared)


def seal(
    recipient: str,
    values: dict[str, str],
    associated: bytes,
    *,
    ephemeral: EphemeralSource = X25519PrivateKey.generate,
) -> SealedSecrets:
    """`values` sealed to the node whose public key (base64) is `recipient`."""
    node = _public(recipient)
    one_time = ephemeral()
    sender = one_time.public_key().public_bytes(_RAW, _PUBLIC_RAW)
    key = _key(one_time.exchange(node), sender, node.public_bytes(_RAW, _PUBLIC_RAW))
    box = ChaCha20Poly1305(key).encrypt(_NONCE, msgspec.json.encode(values), associated)
    return SealedSecrets(
        ephemeral_key=base64.b64encode(sender).decode(),
        ciphertext=base64.b64encode(box).decode(),
    )


def open_sealed(
    private: X25519PrivateKey, sealed: SealedSecrets, associated: bytes
) -> dict[str, str]:
    """The values in `sealed`, or SealingError in one line."""
    sender = _public(sealed.ephemeral_key)
    try:
        box = base64.b64decode(sealed.ciphertext, validate=True)
    except ValueError:
        raise SealingError("the sealed secrets are not base64") from None
    mine = private.public_key().public_bytes(_RAW, _PUBLIC_RAW)
    key = _key(private.exchange(sender), sender.public_bytes(_RAW, _PUBLIC_RAW), mine)
    try:
        plain = ChaCha20Poly1305(key).decrypt(_NONCE, box, associated)
    except InvalidTag:
        raise SealingError(
            "the sealed secrets do not open with this node's key (sealed to another key, "
            "or for another replica)"
        ) from None
    try:
        return _VALUES.decode(plain)
    except msgspec.DecodeError as exc:
        raise SealingError(f"the sealed secrets are not a JSON object of strings: {exc}") from None


def deterministic_ephemeral(randbytes: Callable[[int], bytes]) -> EphemeralSource:
    """One-time keys drawn from `randbytes` (a seeded source): for the simulator and tests
    only, where the same seed must give the same bytes. Never in production: a seeded
    generator is predictable."""
    return lambda: X25519PrivateKey.from_private_bytes(randbytes(32))


class NodeKey:
    """A node's X25519 key pair, kept in `<data-dir>/keys/<node id>.x25519` (the 32 raw
    private bytes, mode 0600, the directory 0700): made on first start, the same afterwards."""

    def __init__(self, private: X25519PrivateKey) -> None:
        self.private = private
        self.public = public_text(private.public_key())

    @staticmethod
    def path(data_dir: Path, node_id: str) -> Path:
        return data_dir / "keys" / f"{node_id}.x25519"

    @classmethod
    def load_or_create(cls, path: Path) -> NodeKey:
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return cls._create(path)
        except OSError as exc:
            raise SealingError(f"cannot read the node key {path}: {exc.strerror}") from None
        if len(raw) != 32:
            raise SealingError(f"the node key {path} is not 32 bytes (remove it to make another)")
        return cls(X25519PrivateKey.from_private_bytes(raw))

    @classmethod
    def _create(cls, path: Path) -> NodeKey:
        private = X25519PrivateKey.generate()
        raw = private.private_bytes(
            _RAW, serialization.PrivateFormat.Raw, serialization.NoEncryption()
        )
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(path.parent, 0o700)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
            with os.fdopen(fd, "wb") as out:
                out.write(raw)
        except FileExistsError:
            return cls.load_or_create(path)  # another start made it meanwhile
        except OSError as exc:
            raise SealingError(f"cannot write the node key {path}: {exc.strerror}") from None
        return cls(private)
