"""The sealing construction (wire/sealing.py), the node's key file, and the secret stores."""

from __future__ import annotations

import asyncio
import random
import stat
from pathlib import Path

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from hypothesis import given, settings, strategies as st

from events import ClusterSpec
from events.contract.messages import SealedSecrets, StartReplica
from events.secret_store import (
    MemorySecretStore,
    SecretStoreError,
    SqliteSecretStore,
    is_reference,
    redact,
    redact_env,
    reference,
)
from wire.sealing import NodeKey, SealingError, aad, deterministic_ephemeral, open_sealed, seal

VALUES = {"HF_TOKEN": "hf_abc", "OPENAI_API_KEY": "sk-xyz"}


def node_key(seed: int = 1) -> NodeKey:
    return NodeKey(X25519PrivateKey.from_private_bytes(random.Random(seed).randbytes(32)))


def test_a_sealed_box_opens_with_the_nodes_key_for_its_replica_only() -> None:
    node = node_key()
    where = aad("gpu-1", "llama-0", 3)
    box = seal(node.public, VALUES, where)
    assert open_sealed(node.private, box, where) == VALUES
    raw = msgspec.json.encode(box)
    assert b"hf_abc" not in raw and b"sk-xyz" not in raw
    for other in (
        aad("gpu-2", "llama-0", 3),
        aad("gpu-1", "llama-1", 3),
        aad("gpu-1", "llama-0", 4),
    ):
        with pytest.raises(SealingError, match="do not open"):
            open_sealed(node.private, box, other)
    with pytest.raises(SealingError, match="do not open"):
        open_sealed(node_key(2).private, box, where)
    tampered = SealedSecrets(ephemeral_key=box.ephemeral_key, ciphertext="A" + box.ciphertext[1:])
    with pytest.raises(SealingError):
        open_sealed(node.private, tampered, where)


def test_each_box_has_its_own_one_time_key() -> None:
    node = node_key()
    where = aad("gpu-1", "r", 1)
    first, second = seal(node.public, VALUES, where), seal(node.public, VALUES, where)
    assert first.ephemeral_key != second.ephemeral_key and first.ciphertext != second.ciphertext
    # The seeded source (simulator, tests) is repeatable; the default is not.
    a = seal(
        node.public, VALUES, where, ephemeral=deterministic_ephemeral(random.Random(1).randbytes)
    )
    b = seal(
        node.public, VALUES, where, ephemeral=deterministic_ephemeral(random.Random(1).randbytes)
    )
    assert a == b


@settings(max_examples=25)
@given(st.dictionaries(st.from_regex(r"[A-Z_]{1,12}", fullmatch=True), st.text(max_size=64)))
def test_any_values_round_trip(values: dict[str, str]) -> None:
    node = node_key()
    where = aad("n", "r", 1)
    assert open_sealed(node.private, seal(node.public, values, where), where) == values


def test_a_bad_public_key_is_one_line() -> None:
    with pytest.raises(SealingError, match="not an X25519 public key"):
        seal("bm90IGEga2V5", VALUES, b"")


def test_the_node_key_is_made_once_mode_0600(tmp_path: Path) -> None:
    path = NodeKey.path(tmp_path, "gpu-1")
    first = NodeKey.load_or_create(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert NodeKey.load_or_create(path).public == first.public
    path.write_bytes(b"short")
    with pytest.raises(SealingError, match="not 32 bytes"):
        NodeKey.load_or_create(path)


def test_start_replica_without_secrets_is_written_as_before() -> None:
    spec = ClusterSpec(name="a", command="x")
    start = StartReplica(command_id="c", replica_id="r", epoch=1, spec=spec)
    assert b"secrets" not in msgspec.json.encode(start)
    assert b"secret_env" not in msgspec.json.encode(spec)


def test_redaction_keeps_references_and_files_and_moves_values() -> None:
    spec = ClusterSpec(
        name="a",
        command="x",
        secret_env={"T": "tok", "F": "file:/etc/t", "R": reference("old")},
    )
    redacted, values = redact(spec)
    assert redacted.secret_env == {"T": reference("tok"), "F": "file:/etc/t", "R": reference("old")}
    assert values == {reference("tok"): "tok"}
    assert is_reference(reference("tok")) and not is_reference("secret:sha256:abc")
    assert redact(redacted) == (redacted, {})


def test_redact_env_moves_names_that_look_secret() -> None:
    spec = ClusterSpec(
        name="a",
        command="x",
        env={
            "HF_TOKEN": "t",
            "db_password": "p",
            "Api_Key": "k",
            "CLIENT_SECRET": "s",
            "MODE": "m",
        },
    )
    moved, values, names = redact_env(spec)
    assert names == ["Api_Key", "CLIENT_SECRET", "HF_TOKEN", "db_password"]
    assert moved.env == {"MODE": "m"}
    assert moved.secret_env == {n: reference(spec.env[n]) for n in names}
    assert set(values.values()) == {"t", "p", "k", "s"}
    same, none, no_names = redact_env(moved)
    assert same is moved and none == {} and no_names == []


def test_the_stores_keep_values_by_digest(tmp_path: Path) -> None:
    async def main() -> None:
        sqlite = SqliteSecretStore.beside(tmp_path / "events.db")
        assert sqlite.path == tmp_path / "events.secrets.db"
        for store in (MemorySecretStore(), sqlite):
            await store.put(reference("v"), "v")
            assert await store.get(reference("v")) == "v"
            assert await store.get(reference("w")) is None
            with pytest.raises(SecretStoreError):
                await store.put(reference("v"), "not v")
        assert stat.S_IMODE(sqlite.path.stat().st_mode) == 0o600
        assert await SqliteSecretStore(sqlite.path).get(reference("v")) == "v"

    asyncio.run(main())
