"""An agent's read of the controllers' leader lease: the record the key holds now, or None
when no controller holds it.

It is one `STREAM.MSG.GET` of the last message on `gpumesh.v1.leader.controller`, sent to the
JetStream API and so answered by the leader of the lease's stream: a quorum read, never a
stale copy. An agent on the minority side of a partition between NATS servers gets no answer
(LeaseUnreadable), and so does not conclude that no controller leads. The node's NATS
permissions allow this request and nothing else of the stream (gpumesh/security/roles.py).
"""

from __future__ import annotations

import base64
from typing import Final

import msgspec

from events.contract import subjects
from events.contract.messages import LeaderRecord
from runtime.env import Bus, BusError, NoResponders, RequestTimeout

from .errors import WireError

_GET: Final = f"$JS.API.STREAM.MSG.GET.{subjects.LEADER_STREAM}"
_NO_MESSAGE: Final = 10037  # "no message found": the key expired or was deleted
_REQUEST: Final = msgspec.json.encode({"last_by_subj": subjects.LEADER})


class LeaseUnreadable(WireError):
    """The lease could not be read now: the answer says nothing about who leads."""


class _Error(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class _Stored(msgspec.Struct):
    seq: int
    data: str = ""  # base64


class _Answer(msgspec.Struct):
    message: _Stored | None = None
    error: _Error | None = None


_DECODE = msgspec.json.Decoder(_Answer)
_RECORD = msgspec.json.Decoder(LeaderRecord)


async def read_lease(bus: Bus, *, timeout: float = 0.5) -> LeaderRecord | None:
    """The lease key's record now; None when it is absent (expired, released, never made)."""
    try:
        reply = await bus.request(_GET, _REQUEST, timeout=timeout)
    except (NoResponders, RequestTimeout, BusError) as exc:
        raise LeaseUnreadable(f"the leader lease cannot be read: {exc}") from None
    try:
        answer = _DECODE.decode(reply.data)
    except msgspec.DecodeError as exc:
        raise LeaseUnreadable(f"the leader lease's answer is not JSON: {exc}") from None
    if answer.error is not None:
        if answer.error.err_code == _NO_MESSAGE:
            return None
        raise LeaseUnreadable(
            f"the leader lease cannot be read: {answer.error.description or answer.error.code}"
        )
    if answer.message is None:
        raise LeaseUnreadable("the leader lease's answer holds no message")
    try:
        return _RECORD.decode(base64.b64decode(answer.message.data))
    except (ValueError, msgspec.DecodeError) as exc:
        raise LeaseUnreadable(f"the leader lease holds no record: {exc}") from None
