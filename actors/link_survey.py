"""The controller's link survey: the links between the nodes a pipeline may use, measured by
the nodes themselves on request, and recorded (docs/sharding.md, Measuring links).

While some cluster's `[sharding]` allows "pipeline", every `interval_s` one round asks up to
`NODES_PER_ROUND` candidate nodes, in node id order (a cursor moves on round to round, so a
larger fleet is covered over several rounds), to measure their links to up to `PEERS_PER_NODE`
peers each: the peers whose link to it is the stalest (never measured first, then by the
position of the last measurement, then by id), skipping pairs measured earlier in the round.
A candidate is a node that could host a stage of such a cluster (the scheduler's filters, with
all its GPUs free), or one that runs a stage of one now.

A node's responder endpoint is learnt from its own answer (LinksReply.endpoint, recorded in
the event): a node is asked even with no peer to measure, and is a peer from then on, also
for the nodes asked after it in the same round. Each answer becomes one
`node.links_measured.v1` in the node's `links/<id>` stream, written by this loop only. A node
that does not answer is skipped until the next round. Planning never waits for a survey: a
pair not measured yet is taken at the spec's assumed `link_gbps` and `link_rtt_ms`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from events import ClusterSpec, EventStoreError, NodeLinksMeasured, stream_of
from events.contract import subjects
from events.contract.messages import LinkPeer, LinksReply, LinksRequest
from runtime.env import BusError, Env

from .live_state import LiveState
from .replica_actor import ACTIVE
from .scheduler import could_host

NODES_PER_ROUND = 8
PEERS_PER_NODE = 16
_REPLY = msgspec.json.Decoder(LinksReply)


def pipeline_specs(live: LiveState) -> list[ClusterSpec]:
    """The live clusters whose `[sharding]` allows pipeline stages across nodes, by name."""
    return [
        view.spec
        for _, view in sorted(live.state.clusters.clusters.items())
        if view.spec.sharding is not None and "pipeline" in view.spec.sharding.parallelism
    ]


class LinkSurvey:
    def __init__(
        self,
        env: Env,
        live: LiveState,
        *,
        interval_s: float,
        request: LinksRequest | None = None,
        log: Any = None,
    ) -> None:
        self.env = env
        self.live = live
        self.interval_s = interval_s
        self.request = request or LinksRequest()
        self.log = log if log is not None else env.log.bind(component="link_survey")
        self._cursor = 0
        self.rounds = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.round()

    def candidates(self) -> list[str]:
        specs = pipeline_specs(self.live)
        if not specs:
            return []
        state = self.live.state
        named = {s.name for s in specs}
        running: set[str] = set()
        for view in state.replicas.replicas.values():
            if view.cluster in named and view.stages and view.status in ACTIVE:
                running.update(view.node_ids)
        now_ns = self.env.clock.wall_ns()
        return [
            node_id
            for node_id, node in sorted(state.nodes.nodes.items())
            if node_id in running
            or any(could_host(node, _one_gpu(spec), now_ns=now_ns) for spec in specs)
        ]

    async def round(self) -> int:
        """One round; how many nodes' measurements it recorded."""
        candidates = self.candidates()
        if not candidates:
            return 0
        self.rounds += 1
        start = self._cursor % len(candidates)
        ordered = candidates[start:] + candidates[:start]
        asked = sorted(ordered[:NODES_PER_ROUND])
        self._cursor = start + len(asked)
        links = self.live.state.links
        endpoints = dict(links.endpoints)
        done: set[tuple[str, str]] = set()
        measured_now: list[NodeLinksMeasured] = []
        for node_id in asked:
            peers = self._peers(node_id, candidates, endpoints, done)
            if not peers and node_id in endpoints:
                continue  # every pair of it measured this round already
            reply = await self._ask(node_id, peers)
            if reply is None:
                continue
            if reply.endpoint:
                endpoints[node_id] = reply.endpoint
            asked_peers = {p.node_id for p in peers}
            measured = tuple(m for m in reply.links if m.peer in asked_peers)
            for m in measured:
                done.add(_pair(node_id, m.peer))
            measured_now.append(
                NodeLinksMeasured(
                    node_id=node_id, endpoint=reply.endpoint, method=reply.method, links=measured
                )
            )
        return await self._record(measured_now)

    def _peers(
        self,
        node_id: str,
        candidates: list[str],
        endpoints: dict[str, str],
        done: set[tuple[str, str]],
    ) -> list[LinkPeer]:
        links = self.live.state.links

        def staleness(peer: str) -> tuple[int, str]:
            seen = links.link(node_id, peer)
            return (seen.position if seen is not None else 0, peer)

        eligible = [
            p
            for p in candidates
            if p != node_id and p in endpoints and _pair(node_id, p) not in done
        ]
        chosen = sorted(eligible, key=staleness)[:PEERS_PER_NODE]
        return [LinkPeer(node_id=p, endpoint=endpoints[p]) for p in chosen]

    async def _ask(self, node_id: str, peers: list[LinkPeer]) -> LinksReply | None:
        request = msgspec.structs.replace(self.request, peers=tuple(peers))
        timeout = request.timeout_s * max(1, len(peers)) + 2.0
        try:
            answer = await self.env.bus.request(
                subjects.links(node_id), msgspec.json.encode(request), timeout=timeout
            )
            reply = _REPLY.decode(answer.data)
        except BusError as exc:  # no responders, a timeout, NATS away: next round
            self.log.info("links_not_measured", node=node_id, error=str(exc) or type(exc).__name__)
            return None
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.log.warning("links_reply_undecodable", node=node_id, error=str(exc)[:200])
            return None
        if not reply.ok or reply.node_id != node_id:
            why = reply.error or f"a reply for {reply.node_id!r}"
            self.log.warning("links_refused", node=node_id, error=why[:200])
            return None
        return reply

    async def _record(self, measured: list[NodeLinksMeasured]) -> int:
        """The round's measurements in one submission, so that the fleet's view takes the
        round whole: a placement does not act on half of it (one link seen slow, its
        alternative not measured yet). How many were recorded."""
        store = self.env.store
        appends = []
        try:
            for event in measured:
                stream = stream_of(event)
                version = await store.stream_version(stream)
                appends.append((stream, [self.env.new_event(event)], version))
            outcomes = await store.append_many(appends) if appends else []
        except EventStoreError as exc:
            self.log.warning("links_not_recorded", error=str(exc))
            return 0
        recorded = 0
        for event, outcome in zip(measured, outcomes, strict=True):
            if isinstance(outcome, EventStoreError):
                self.log.warning("links_not_recorded", node=event.node_id, error=str(outcome))
            else:
                recorded += 1
        return recorded


def _pair(a: str, b: str) -> tuple[str, str]:
    return (a, b) if a < b else (b, a)


def _one_gpu(spec: ClusterSpec) -> ClusterSpec:
    """A stage needs one GPU at least: a node with fewer than `gpu.count` may hold one."""
    return msgspec.structs.replace(spec, gpu=msgspec.structs.replace(spec.gpu, count=1))
