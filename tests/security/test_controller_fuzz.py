"""Garbage on every subject the controller reads, on virtual time: each message is dropped and
counted or answered with a one-line error, and the controller goes
on serving a valid request afterwards."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings, strategies as st

import projections
from events.contract import subjects
from events.contract.messages import ApiReply
from sim import run_simulation
from tests.control.harness import fleet
from tests.security.test_decoders_fuzz import payloads

AGENT_SUBJECTS = [
    subjects.heartbeat("n0"),
    subjects.register("n0"),
    subjects.report("n0"),
    subjects.heartbeat("ghost"),
    subjects.register("ghost"),
    subjects.SUSPECT,
]
messages = st.lists(
    st.tuples(st.sampled_from(AGENT_SUBJECTS + list(subjects.API_VERBS)), payloads),
    min_size=1,
    max_size=12,
)


@settings(max_examples=25)
@given(messages)
def test_garbage_on_any_subject_is_dropped_and_the_controller_goes_on(
    batch: list[tuple[str, bytes]],
) -> None:
    async def main() -> None:
        async with fleet(1) as f:
            for target, data in batch:
                if target in subjects.API_VERBS:
                    raw = await f.bus.request(subjects.api(target), data, timeout=30.0)
                    reply = msgspec.json.decode(raw.data, type=ApiReply)
                    if not reply.ok:
                        assert reply.error and "\n" not in reply.error, reply.error
                else:
                    await f.bus.publish(target, data)
            # Still serving, still consistent.
            listed = await f.api("cluster.list")
            assert listed.ok, listed.error
            assert f.state.nodes.nodes["n0"].health == "healthy"
            assert projections.rebuild(f.store.read_all_now()) == f.state

    run_simulation(main())
