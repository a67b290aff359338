"""The control API: request/reply on `gpumesh.v1.api.<verb>`, one ApiReply per request."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from events import ClusterCreated, ClusterScaled, ClusterSpec, ClusterSpecChanged, stream_name
from events.catalog import HEARTBEAT_TYPE
from events.contract import subjects
from events.contract.messages import (
    ApiReply,
    CanaryEndRequest,
    CanaryRequest,
    CordonRequest,
    DrainRequest,
    EventsRequest,
    NameRequest,
    RollbackRequest,
    ScaleRequest,
)
from events.errors import EventStoreError, StoreFull
from events.ids import valid_id
from projections import FleetState
from projections.views import NodeView
from runtime.env import Msg

from .cluster_actor import (
    Apply,
    ClusterError,
    Create,
    Delete,
    EndCanary,
    Revised,
    Rollback,
    Scale,
    StartCanary,
    describe_change,
)
from .node_actor import Cordon, Drain, NotRemovable, Remove, Uncordon, Undrain
from .scheduler import cordon_end, cordoned
from .secret_keeper import SecretsUnavailable
from .sharding import NoPlan, plan
from .spec import SpecError, from_mapping

if TYPE_CHECKING:
    from .controller import Controller

_PREFIX = f"{subjects.PREFIX}.api."
_MAX_EVENTS = 1000
_SCAN_PAGES = 20


class ControlApi:
    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self._verbs: dict[str, Callable[[bytes], Awaitable[Any]]] = {
            "cluster.create": self._create,
            "cluster.list": self._list,
            "cluster.get": self._get,
            "cluster.scale": self._scale,
            "cluster.delete": self._delete,
            "cluster.apply": self._apply,
            "cluster.history": self._history,
            "cluster.canary": self._canary,
            "cluster.promote": self._promote,
            "cluster.abort": self._abort,
            "cluster.rollback": self._rollback,
            "cluster.plan": self._plan,
            "node.list": self._nodes,
            "node.drain": self._drain,
            "node.undrain": self._undrain,
            "node.remove": self._remove,
            "node.cordon": self._cordon,
            "node.uncordon": self._uncordon,
            "routing.get": self._routing,
            "events.list": self._events,
        }

    async def handle(self, msg: Msg) -> None:
        verb = msg.subject.removeprefix(_PREFIX)
        try:
            handler = self._verbs.get(verb)
            if handler is None:
                raise ClusterError(f"unknown API verb {verb!r}")
            reply = ApiReply(ok=True, data=await handler(msg.data))
        except (ClusterError, SpecError, NotRemovable, SecretsUnavailable) as exc:
            reply = ApiReply(ok=False, error=str(exc))
        except StoreFull as exc:
            # Reads go on; a write is refused whole (nothing of it was appended).
            reply = ApiReply(ok=False, error=f"refused: {exc}")
        except EventStoreError as exc:
            reply = ApiReply(ok=False, error=f"the event log failed: {exc}")
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            reply = ApiReply(ok=False, error=f"bad request body: {exc}")
        if msg.reply:
            await self.controller.env.bus.publish(msg.reply, msgspec.json.encode(reply))

    @property
    def state(self) -> FleetState:
        return self.controller.live.state

    async def _create(self, body: bytes) -> Any:
        spec = await self.controller.secrets.redact(from_mapping(msgspec.json.decode(body)))
        ref = await self.controller.cluster(spec.name)
        await ref.ask(Create(spec), timeout=30.0)
        return self._cluster(spec.name)

    async def _apply(self, body: bytes) -> Any:
        spec = await self.controller.secrets.redact(from_mapping(msgspec.json.decode(body)))
        ref = await self.controller.cluster(spec.name)
        done = await ref.ask(Apply(spec), timeout=30.0, expect=Revised)
        return self._revised(spec.name, done)

    async def _canary(self, body: bytes) -> Any:
        """Create `<name>-canary` with the new spec, sized to its share of the cluster's
        replicas (one at least), then record the split in the cluster's stream."""
        req = msgspec.json.decode(body, type=CanaryRequest)
        if not 1 <= req.weight <= 99:
            raise SpecError(f"weight: must be 1..99 (percent of the requests), got {req.weight}")
        self._known(req.name)
        spec = from_mapping({**req.spec, "name": req.spec.get("name", req.name)})
        spec = await self.controller.secrets.redact(spec)
        if spec.name != req.name:
            raise SpecError(f"spec.name: {spec.name!r} is not the cluster {req.name!r}")
        view = self.state.clusters.clusters[req.name]
        if view.canary:
            raise ClusterError(
                f"cluster {req.name!r} already has a canary ({view.canary}): "
                "promote or abort it first"
            )
        canary = f"{req.name}-canary"
        if not valid_id(canary):
            raise SpecError(f"name: {req.name!r} is too long to name its canary {canary!r}")
        if canary in self.state.clusters.clusters:
            raise ClusterError(f"a cluster named {canary!r} exists already: delete it first")
        replicas = max(1, math.ceil(view.spec.replicas * req.weight / 100))
        # The cluster's model name: the split hands the canary requests that name the
        # cluster's model, and an engine started for another name would refuse them (vLLM's
        # --served-model-name, the echo workload's --model). No autoscaling of its own: its
        # count follows the weight.
        canary_spec = msgspec.structs.replace(
            spec, name=canary, model=view.spec.model or req.name, replicas=replicas, autoscale=None
        )
        # The split first: from then on the canary's model name is known to be its cluster's
        # (Controller._models), never a second way to name that model.
        ref = await self.controller.cluster(req.name)
        await ref.ask(StartCanary(canary, req.weight), timeout=30.0)
        try:
            await (await self.controller.cluster(canary)).ask(Create(canary_spec), timeout=30.0)
        except BaseException as exc:
            why = f"its cluster could not be created: {exc}"
            await ref.ask(EndCanary("aborted", why[:200]), timeout=30.0, expect=Revised)
            raise
        return self._cluster(req.name)

    async def _promote(self, body: bytes) -> Any:
        return await self._end_canary(body, "promoted")

    async def _abort(self, body: bytes) -> Any:
        return await self._end_canary(body, "aborted")

    async def _end_canary(self, body: bytes, outcome: str) -> Any:
        req = msgspec.json.decode(body, type=CanaryEndRequest)
        self._known(req.name)
        canary = self.state.clusters.clusters[req.name].canary
        if not canary:
            verb = "promote" if outcome == "promoted" else "abort"
            raise ClusterError(f"cluster {req.name!r} has no canary to {verb}")
        canary_view = self.state.clusters.clusters.get(canary)
        promoted = canary_view.spec if outcome == "promoted" and canary_view else None
        ref = await self.controller.cluster(req.name)
        done = await ref.ask(EndCanary(outcome, req.reason, promoted), timeout=30.0, expect=Revised)
        if canary in self.state.clusters.clusters:
            await (await self.controller.cluster(canary)).ask(Delete(), timeout=30.0)
        return self._revised(req.name, done)

    async def _rollback(self, body: bytes) -> Any:
        req = msgspec.json.decode(body, type=RollbackRequest)
        if req.to < 0:
            raise SpecError(f"to: must be a revision number (1 or more), got {req.to}")
        self._known(req.name)
        ref = await self.controller.cluster(req.name)
        done = await ref.ask(Rollback(req.to), timeout=30.0, expect=Revised)
        return self._revised(req.name, done)

    async def _plan(self, body: bytes) -> Any:
        """The sharding plan for the spec on the fleet as it is; places nothing."""
        spec = from_mapping(msgspec.json.decode(body))
        if spec.sharding is None:
            raise SpecError("sharding: the spec has no [sharding] section to plan from")
        state = self.state
        nodes = [n for _, n in sorted(state.nodes.nodes.items())]
        replicas = [r for _, r in sorted(state.replicas.replicas.items())]
        now_ns = self.controller.env.clock.wall_ns()
        result = plan(spec, nodes, replicas, now_ns=now_ns, links=state.links)
        return {"fits": not isinstance(result, NoPlan), **msgspec.to_builtins(result)}

    def _revised(self, name: str, done: Revised) -> dict[str, Any]:
        return {**self._cluster(name), "changed": done.changed, "message": done.message}

    async def _history(self, body: bytes) -> Any:
        req = msgspec.json.decode(body, type=NameRequest)
        self._known(req.name)
        envelopes = await self.controller.env.store.read_stream(stream_name("cluster", req.name))
        revisions: list[dict[str, Any]] = []
        previous: ClusterSpec | None = None
        for envelope in envelopes:
            match envelope.payload:
                case ClusterCreated(spec=spec):
                    revisions, previous = [], None  # created again after a delete: a new life
                    number, reason, to = 1, "created", 0
                case ClusterSpecChanged(spec=spec, revision=revision, reason=reason):
                    number = revision or (revisions[-1]["revision"] + 1 if revisions else 1)
                    to = envelope.payload.rollback_to
                case ClusterScaled(replicas=replicas) if previous is not None:
                    # Not a revision, but what ran before the next one: its change is against it.
                    previous = msgspec.structs.replace(previous, replicas=replicas)
                    continue
                case _:
                    continue
            revisions.append(
                {
                    "revision": number,
                    "recorded_at": envelope.recorded_at,
                    "reason": reason,
                    "rollback_to": to,
                    "change": describe_change(previous, spec),
                    "spec": msgspec.to_builtins(spec),
                }
            )
            previous = spec
        view = self.state.clusters.clusters[req.name]
        return {
            "name": req.name,
            "revision": view.revision,
            "rolled_out": view.rolled_out,
            "revisions": revisions,
        }

    async def _scale(self, body: bytes) -> Any:
        req = msgspec.json.decode(body, type=ScaleRequest)
        if not 0 <= req.replicas <= 1000:
            raise SpecError(f"replicas: must be 0..1000, got {req.replicas}")
        self._known(req.name)
        await (await self.controller.cluster(req.name)).ask(Scale(req.replicas), timeout=30.0)
        return self._cluster(req.name)

    async def _delete(self, body: bytes) -> Any:
        req = msgspec.json.decode(body, type=NameRequest)
        self._known(req.name)
        await (await self.controller.cluster(req.name)).ask(Delete(), timeout=30.0)
        return {"name": req.name, "deleted": True}

    async def _get(self, body: bytes) -> Any:
        req = msgspec.json.decode(body, type=NameRequest)
        self._known(req.name)
        return self._cluster(req.name)

    async def _list(self, body: bytes) -> Any:
        return [self._cluster(name) for name in sorted(self.state.clusters.clusters)]

    async def _nodes(self, body: bytes) -> Any:
        return [msgspec.to_builtins(n) for _, n in sorted(self.state.nodes.nodes.items())]

    async def _drain(self, body: bytes) -> Any:
        req = msgspec.json.decode(body, type=DrainRequest)
        self._known_node(req.node_id)
        ref = await self.controller.node(req.node_id)
        await ref.ask(Drain("drained by operator"), timeout=30.0)
        return {"node_id": req.node_id, "drained": True}

    async def _undrain(self, body: bytes) -> Any:
        req = msgspec.json.decode(body, type=DrainRequest)
        node = self._known_node(req.node_id)
        if not node.drained:
            raise ClusterError(f"node {req.node_id!r} is not drained")
        ref = await self.controller.node(req.node_id)
        await ref.ask(Undrain("undrained by operator"), timeout=30.0)
        return {"node_id": req.node_id, "drained": False}

    async def _remove(self, body: bytes) -> Any:
        req = msgspec.json.decode(body, type=DrainRequest)
        self._known_node(req.node_id)
        ref = await self.controller.node(req.node_id)
        await ref.ask(Remove("removed by operator"), timeout=30.0)
        return {"node_id": req.node_id, "removed": True}

    async def _cordon(self, body: bytes) -> Any:
        req = msgspec.json.decode(body, type=CordonRequest)
        self._known_node(req.node_id)
        now = self.controller.env.clock.wall_ns()
        if req.until_ns < 0 or 0 < req.until_ns <= now:
            raise ClusterError(
                f"until: {cordon_end(req.until_ns) if req.until_ns > 0 else req.until_ns} is "
                f"in the past (now {cordon_end(now)})"
            )
        reason = " ".join(req.reason.split()) or "cordoned by operator"
        ref = await self.controller.node(req.node_id)
        await ref.ask(Cordon(req.until_ns, reason), timeout=30.0)
        return {
            "node_id": req.node_id,
            "cordoned": True,
            "until_ns": req.until_ns,
            "reason": reason,
        }

    async def _uncordon(self, body: bytes) -> Any:
        req = msgspec.json.decode(body, type=DrainRequest)
        node = self._known_node(req.node_id)
        if not node.cordoned_until_ns:
            raise ClusterError(f"node {req.node_id!r} is not cordoned")
        if not cordoned(node, self.controller.env.clock.wall_ns()):
            ended = cordon_end(node.cordoned_until_ns)
            raise ClusterError(f"node {req.node_id!r} is not cordoned (its cordon ended {ended})")
        ref = await self.controller.node(req.node_id)
        await ref.ask(Uncordon("uncordoned by operator"), timeout=30.0)
        return {"node_id": req.node_id, "cordoned": False}

    def _known_node(self, node_id: str) -> NodeView:
        node = self.state.nodes.nodes.get(node_id)
        if node is None:
            raise ClusterError(f"unknown node {node_id!r}")
        return node

    async def _routing(self, body: bytes) -> Any:
        return msgspec.json.decode(self.controller.routing_update())

    async def _events(self, body: bytes) -> Any:
        req = msgspec.json.decode(body or b"{}", type=EventsRequest)
        if req.after < 0:
            raise SpecError(f"after: must be >= 0, got {req.after}")
        if not 1 <= req.limit <= _MAX_EVENTS:
            raise SpecError(f"limit: must be 1..{_MAX_EVENTS}, got {req.limit}")
        store = self.controller.env.store
        found: list[Any] = []
        cursor = req.after
        # Heartbeats are most of the log: scan a bounded number of pages past them so that one
        # request makes progress without reading the whole log.
        for _ in range(_SCAN_PAGES):
            page = await store.read_all(cursor + 1, req.limit)
            if not page:
                break
            for envelope in page:
                cursor = envelope.position
                if req.heartbeats or envelope.type != HEARTBEAT_TYPE:
                    found.append(msgspec.to_builtins(envelope))
                    if len(found) == req.limit:
                        break
            if len(found) == req.limit:
                break
        return {"events": found, "next": cursor, "head": await store.head()}

    def _known(self, name: str) -> None:
        if name not in self.state.clusters.clusters:
            known = ", ".join(sorted(self.state.clusters.clusters)) or "none"
            raise ClusterError(f"unknown cluster {name!r} (known: {known})")

    def _cluster(self, name: str) -> dict[str, Any]:
        view = self.state.clusters.clusters[name]
        replicas = sorted(
            (r for r in self.state.replicas.replicas.values() if r.cluster == name),
            key=lambda r: r.replica_id,
        )
        return {
            "name": name,
            "desired": view.spec.replicas,
            "ready": sum(1 for r in replicas if r.status == "ready"),
            "revision": view.revision,
            "rolled_out": view.rolled_out,
            "unschedulable": view.unschedulable,
            "canary": {"cluster": view.canary, "weight": view.canary_weight}
            if view.canary
            else None,
            "spec": msgspec.to_builtins(view.spec),
            "replicas": [
                {
                    "replica_id": r.replica_id,
                    "node_id": r.node_id,
                    "epoch": r.epoch,
                    "revision": r.revision or 1,
                    "status": r.status,
                    "address": r.address,
                    "why": r.why,
                    "failure": r.failure_reason,
                    # A pipeline's stages (docs/sharding.md); [] for a replica on one node.
                    "stages": [
                        {
                            "rank": s.rank,
                            "node_id": s.node_id,
                            "gpu_indices": list(s.gpu_indices),
                            "layers": [s.first_layer, s.last_layer],
                            "up": s.rank == 0 or s.rank in r.stage_addresses,
                        }
                        for s in r.stages
                    ],
                }
                for r in replicas
            ],
        }
