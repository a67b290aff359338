"""The controllers' secret store on JetStream: the key-value bucket `GPUMESH_SECRETS`.

Every controller of a stack reaches it (a standby that takes over seals the same values), with
as many copies as the NATS cluster allows. Only the `controller` and `admin` roles may touch it:
the node, gateway and integrator permissions (gpumesh/security/roles.py) name no subject of its
stream (`$KV.GPUMESH_SECRETS.>`, `$JS.API.*.KV_GPUMESH_SECRETS`), so the server refuses them
(tests/test_nats_roles.py; tests/integration/test_nats_security.py, with a real server).

A value's key is its digest's hex (a KV key may not hold `:`): `secret:sha256:<hex>` -> `<hex>`.
"""

from __future__ import annotations

from typing import Final

import nats.errors
import nats.js.errors
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from events.secret_store import SECRET_PREFIX, SecretStoreError, is_reference, reference

from .nats_bus import NatsBus, describe

BUCKET: Final = "GPUMESH_SECRETS"
STREAM: Final = f"KV_{BUCKET}"  # the stream under the bucket, as JetStream names it


class JetStreamSecretStore:
    """SecretStore on the `GPUMESH_SECRETS` bucket, created on first use."""

    def __init__(self, bus: NatsBus, *, timeout: float = 5.0) -> None:
        self._bus = bus
        self._timeout = timeout
        self._kv: KeyValue | None = None

    async def _bucket(self) -> KeyValue:
        if self._kv is not None:
            return self._kv
        js = self._bus.jetstream(timeout=self._timeout)
        try:
            try:
                self._kv = await js.key_value(BUCKET)
            except nats.js.errors.BucketNotFoundError:
                self._kv = await js.create_key_value(
                    KeyValueConfig(
                        bucket=BUCKET,
                        description="gpumesh: secret values by digest (docs/security.md)",
                        history=1,
                        storage=StorageType.FILE,
                        replicas=self._bus.stream_replicas,
                    )
                )
        except (nats.errors.Error, TimeoutError) as exc:
            raise SecretStoreError(f"secret bucket {BUCKET}: {describe(exc)}") from None
        return self._kv

    async def put(self, ref: str, value: str) -> None:
        if ref != reference(value):
            raise SecretStoreError("a secret's reference must be its digest")
        kv = await self._bucket()
        try:
            await kv.put(_key(ref), value.encode())
        except (nats.errors.Error, TimeoutError) as exc:
            raise SecretStoreError(f"secret bucket {BUCKET}: {describe(exc)}") from None

    async def get(self, ref: str) -> str | None:
        if not is_reference(ref):
            return None
        kv = await self._bucket()
        try:
            entry = await kv.get(_key(ref))
        except nats.js.errors.KeyNotFoundError:
            return None
        except (nats.errors.Error, TimeoutError) as exc:
            raise SecretStoreError(f"secret bucket {BUCKET}: {describe(exc)}") from None
        return None if entry.value is None else entry.value.decode()


def _key(ref: str) -> str:
    return ref.removeprefix(SECRET_PREFIX)
