"""Events of controllers: what one decided about itself (in its stream,
`controller/<controller_id>`), and the terms of leadership (`leadership/terms`)."""

from __future__ import annotations

from typing import Literal

import msgspec

GraceReason = Literal[
    "started",  # it began to take heartbeats in for the first time in this process
    "reconnected",  # it came back to NATS after losing its connection
]


class ControllerGrace(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="controller.grace.v1"
):
    """The controller began to take heartbeats in. While none did, agents kept serving on
    their last lease, so for `grace_s` it declares no node it has not heard from since suspect
    or offline, and places replicas only on nodes it has heard from."""

    controller_id: str
    reason: GraceReason
    grace_s: float
    lease_s: float  # the longest lease a node may still hold from before


TERMS_STREAM = "leadership/terms"


class LeaderTermBegan(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="controller.term.v1"
):
    """A controller won the lease and leads `term` from here on. The last record in
    `leadership/terms` fences the log: on JetStream every append of a leader is conditional on
    this stream still ending at its own record (actors/fenced_store.py), so once a successor
    has written its record, nothing of an older term can reach the log."""

    controller_id: str
    term: int
