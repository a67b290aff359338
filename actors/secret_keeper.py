"""The controller's side of a spec's secrets: kept out of the log, sealed to one node.

`redact` runs where a spec enters (the control API's create, apply, canary): every inline
`secret_env` value goes into the secret store, keyed by its digest, and the spec keeps only the
reference, so the log, the outbox's events, the API's views and every subject carry the
reference alone. `seal_for` runs when a replica is placed: the values of its spec's references,
sealed to the node's key (wire/sealing.py) for its StartReplica. The store is injected (memory,
SQLite beside the log, or the JetStream bucket); this module touches no NATS itself.
"""

from __future__ import annotations

from collections.abc import Callable

from events import ClusterSpec
from events.contract.messages import SealedSecrets
from events.secret_store import (
    SecretStore,
    SecretStoreError,
    is_file,
    is_reference,
    redact,
)
from projections.views import NodeView
from wire.sealing import EphemeralSource, SealingError, aad, seal

from .errors import ControllerError
from .spec import SpecError


class SecretsUnavailable(ControllerError):
    """The secrets a replica needs cannot go to its node: one line saying why."""


class SecretKeeper:
    def __init__(
        self,
        store: SecretStore,
        node: Callable[[str], NodeView | None],
        *,
        ephemeral: EphemeralSource | None = None,
    ) -> None:
        """`node`: the node's view in live state (its registration's sealing key).
        `ephemeral`: the one-time keys' source; None draws them from the OS."""
        self.store = store
        self._node = node
        self._ephemeral = ephemeral
        self._held: set[str] = set()  # references seen in the store (a digest's value is fixed)

    async def redact(self, spec: ClusterSpec) -> ClusterSpec:
        """The spec as it may be recorded: inline values stored and replaced by references.
        A reference must name a value the store holds."""
        for name, value in spec.secret_env.items():
            if is_reference(value) and await self._get(value) is None:
                raise SpecError(
                    f"secret_env.{name}: the controller's secret store has no value for "
                    f"{value[:30]}... (give the value itself)"
                )
        redacted, values = redact(spec)
        for ref, value in values.items():
            try:
                await self.store.put(ref, value)
            except SecretStoreError as exc:
                raise SecretsUnavailable(f"secret_env: cannot store a secret: {exc}") from None
        return redacted

    async def unavailable(self, spec: ClusterSpec) -> str:
        """Why no replica of `spec` can be given its secrets anywhere ('' when it can): a
        reference whose value the store lacks (a log restored without its secret store, a
        controller given another store). The placement says so instead of placing replicas
        that would each fail at once."""
        for name, ref in sorted(spec.secret_env.items()):
            if is_file(ref) or ref in self._held:
                continue
            if not is_reference(ref):
                return f"secret_env.{name}: not a reference (never recorded)"
            try:
                value = await self._get(ref)
            except SecretsUnavailable as exc:
                return exc.reason
            if value is None:
                return (
                    f"secret_env.{name}: the controller's secret store has no value for "
                    f"{ref[:30]}... (apply the spec again with the value)"
                )
            self._held.add(ref)
        return ""

    async def seal_for(
        self, node_id: str, replica_id: str, epoch: int, spec: ClusterSpec
    ) -> SealedSecrets | None:
        """The sealed values of `spec`'s references for `node_id`; None when it has none.
        SecretsUnavailable when they cannot go there (the node has no key: an older agent,
        which would start the workload without them)."""
        if not spec.secret_env:
            return None
        view = self._node(node_id)
        if view is None or not view.sealing_key:
            raise SecretsUnavailable(
                f"node {node_id} has no sealing key (an agent older than secret_env): "
                f"the secrets {', '.join(sorted(spec.secret_env))} cannot be sent to it"
            )
        values: dict[str, str] = {}
        for name, ref in sorted(spec.secret_env.items()):
            if is_file(ref):
                continue  # the agent reads it on the node
            if not is_reference(ref):
                raise SecretsUnavailable(f"secret_env.{name}: not a reference (never recorded)")
            value = await self._get(ref)
            if value is None:
                raise SecretsUnavailable(
                    f"secret_env.{name}: the controller's secret store has no value for "
                    f"{ref[:30]}... (apply the spec again with the value)"
                )
            values[name] = value
        if not values:
            return None
        try:
            if self._ephemeral is None:
                return seal(view.sealing_key, values, aad(node_id, replica_id, epoch))
            return seal(
                view.sealing_key,
                values,
                aad(node_id, replica_id, epoch),
                ephemeral=self._ephemeral,
            )
        except SealingError as exc:
            raise SecretsUnavailable(f"node {node_id}: {exc.reason}") from None

    async def _get(self, ref: str) -> str | None:
        try:
            return await self.store.get(ref)
        except SecretStoreError as exc:
            raise SecretsUnavailable(f"secret_env: cannot read the secret store: {exc}") from None
