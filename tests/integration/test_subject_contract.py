"""docs/subjects.md is executable: every example travels through a real server and decodes.

The page documents each subject in a small table (Subject, Wildcard, Pattern, Payload, Reply)
followed by `Example on `<subject>`:` and `Example reply...:` JSON blocks, and each payload type
in a field table under a `#### `module.Struct`` heading. These tests parse exactly that, so a
renamed subject, a new field or a changed tag fails here until the page says the same.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import re
import types
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

from actors.outbox import OutboxPublisher
from events import MemoryEventStore
from events.catalog import EVENT_TYPES, DomainEvent, type_tag_of_class
from events.contract import subjects
from events.contract.messages import WireMessage
from events.envelope import Undecodable
from sim.bus import subject_matches
from wire.nats_bus import NatsBus
from wire.nats_commands import JetStreamCommandQueue

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[2] / "docs" / "subjects.md"
Connect = Callable[[str], Awaitable[NatsBus]]

_HEADING = re.compile(r"^#{3,4} (.+)$", re.M)
_ROW = re.compile(r"^\| (Subject|Wildcard|Pattern|Payload|Reply) \| (.*) \|$", re.M)
_EXAMPLE = re.compile(
    r"^Example (?:on `([^`]+)`|reply[^:\n]*):\n\n```json\n(.*?)\n```", re.M | re.S
)
_FIELD_TABLE = re.compile(r"^#### `([\w.]+)`\n(.*?)(?=^#|\Z)", re.M | re.S)


@dataclass
class Example:
    subject: str  # "" for a reply
    raw: bytes


@dataclass
class Section:
    title: str
    rows: dict[str, str]
    requests: list[Example] = field(default_factory=list)
    replies: list[Example] = field(default_factory=list)

    def cell(self, name: str) -> str:
        """The first `code` span of a row: the machine-readable part."""
        m = re.search(r"`([^`]+)`", self.rows[name])
        assert m, f"{self.title}: the {name} row has no `code` span"
        return m.group(1)


def doc_text() -> str:
    return DOC.read_text()


def sections() -> list[Section]:
    text = doc_text()
    found = []
    heads = list(_HEADING.finditer(text))
    for head, nxt in zip(heads, [*heads[1:], None], strict=True):
        body = text[head.end() : nxt.start() if nxt else len(text)]
        rows = dict(_ROW.findall(body))
        if "Payload" not in rows:
            continue
        section = Section(head.group(1), rows)
        for subject, raw in _EXAMPLE.findall(body):
            target = section.requests if subject else section.replies
            target.append(Example(subject, raw.encode()))
        found.append(section)
    return found


def resolve(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def check_decodes(raw: bytes, type_path: str, where: str) -> None:
    """Decodes with the documented type, and is written exactly as gpumesh would write it."""
    if type_path == "{}":
        assert json.loads(raw) == {}, where
        return
    value = msgspec.json.decode(raw, type=resolve(type_path))
    assert json.loads(msgspec.json.encode(value)) == json.loads(raw), (
        f"{where}: not canonical (a misspelt field, or a default written out?)"
    )


def as_wildcard(template: str) -> str:
    return re.sub(r"<[^>]+>", "*", template)


SECTIONS = sections()


def test_the_page_is_parsed_whole() -> None:
    text = doc_text()
    parsed = sum(len(s.requests) + len(s.replies) for s in SECTIONS)
    assert parsed == text.count("```json"), "a JSON block without its `Example on` line"
    assert len(SECTIONS) >= 8 + len(subjects.API_VERBS) - 1
    documented_verbs = {s.cell("Subject").removeprefix(f"{subjects.PREFIX}.api.") for s in SECTIONS}
    assert set(subjects.API_VERBS) <= documented_verbs
    for section in SECTIONS:
        assert section.requests, f"{section.title}: no example"
        assert len(section.replies) <= len(section.requests), section.title
        assert ("Reply" in section.rows) == ("request/reply" in section.rows["Pattern"])
        if section.replies:
            assert "Reply" in section.rows, section.title


def test_every_name_in_the_subjects_module_is_documented() -> None:
    text = doc_text()
    public = [
        name
        for name, value in vars(subjects).items()
        if not name.startswith("_")
        and (
            (name.isupper() and isinstance(value, str | tuple))
            or (inspect.isfunction(value) and value.__module__ == subjects.__name__)
        )
    ]
    assert len(public) > 10
    missing = [n for n in public if not re.search(rf"events\.contract\.subjects\.{n}\b", text)]
    assert missing == []


def test_examples_match_their_subjects_and_builders() -> None:
    built = {
        subjects.register("gpu-1"),
        subjects.heartbeat("gpu-1"),
        subjects.report("gpu-1"),
        subjects.leaving("gpu-1"),
        subjects.command("gpu-1"),
        subjects.fault("gpu-1"),
        subjects.links("gpu-1"),
        subjects.event("node/gpu-1"),
        subjects.ROUTING,
        subjects.SUSPECT,
        subjects.LOAD,
        subjects.QUOTA,
        subjects.CRL,
        subjects.CRL_GET,
        *(subjects.api(verb) for verb in subjects.API_VERBS),
    }
    used = set()
    for section in SECTIONS:
        wildcard = section.cell("Wildcard")
        for example in section.requests:
            assert subject_matches(as_wildcard(section.cell("Subject")), example.subject)
            assert subject_matches(wildcard, example.subject), (section.title, example.subject)
            used.add(example.subject)
    assert used == built  # one example at least for every subject the code can build
    constants = {
        subjects.REGISTER_ALL, subjects.HEARTBEAT_ALL, subjects.REPORT_ALL,
        subjects.LEAVING_ALL, subjects.COMMAND_ALL, subjects.EVENTS_ALL, subjects.ROUTING,
        subjects.API_ALL, subjects.SUSPECT, subjects.LOAD, subjects.QUOTA, subjects.CRL,
        subjects.CRL_GET,
    }  # fmt: skip
    assert constants <= {s.cell("Wildcard") for s in SECTIONS}


def test_field_tables_list_exactly_the_struct_fields() -> None:
    tables = dict(_FIELD_TABLE.findall(doc_text()))
    needed: set[type[msgspec.Struct]] = set()
    for section in SECTIONS:
        for row in ("Payload", "Reply"):
            if row in section.rows and section.cell(row) != "{}":
                needed |= _structs_in(resolve(section.cell(row)))
    needed |= _structs_in(WireMessage)
    assert needed
    for cls in sorted(needed, key=lambda c: c.__name__):
        path = f"{cls.__module__}.{cls.__name__}"
        assert path in tables, f"no field table for {path}"
        body = tables[path]
        documented = re.findall(r"^\| `(\w+)` \|", body, re.M)
        # The names on the wire (a field may be renamed there: AutoscaleSpec's `min`).
        assert documented == [f.encode_name for f in msgspec.structs.fields(cls)], path
        tag = cls.__struct_config__.tag
        if isinstance(tag, str):
            assert f'`"type": "{tag}"`' in body, path


def test_every_domain_event_tag_is_listed() -> None:
    text = doc_text()
    for cls in EVENT_TYPES:
        row = f"| `{type_tag_of_class(cls)}` |"
        assert row in text and f"`{cls.__module__}.{cls.__name__}`" in text, cls.__name__


_DOMAIN = set(typing.get_args(DomainEvent)) | {Undecodable}


def _structs_in(tp: Any) -> set[type[msgspec.Struct]]:
    """The Struct types reachable from `tp` through fields, except the domain events (which
    the page lists by tag rather than field by field)."""
    found: set[type[msgspec.Struct]] = set()
    stack = [tp]
    while stack:
        t = stack.pop()
        if isinstance(t, type) and issubclass(t, msgspec.Struct):
            if t in found or t in _DOMAIN:
                continue
            found.add(t)
            stack.extend(typing.get_type_hints(t).values())
        elif typing.get_origin(t) is not None or isinstance(t, types.UnionType):
            stack.extend(typing.get_args(t))
    return found


@pytest.mark.parametrize("section", SECTIONS, ids=[s.title.strip("`") for s in SECTIONS])
async def test_every_example_travels_and_decodes(
    section: Section, bus: NatsBus, connect: Connect
) -> None:
    wildcard = section.cell("Wildcard")
    payload = section.cell("Payload")
    receiver = await connect("receiver")
    sub = await receiver.subscribe(wildcard)

    if "Reply" not in section.rows:
        for example in section.requests:
            await bus.publish(example.subject, example.raw)
            got = await sub.next_msg(timeout=5)
            assert got.subject == example.subject
            check_decodes(got.data, payload, f"{section.title} on {example.subject}")
    else:
        reply_type = section.cell("Reply")
        answers: list[Example | None] = [*section.replies] or [None]
        for i, example in enumerate(section.requests):
            answer = answers[i % len(answers)]

            async def serve(answer: Example | None = answer) -> None:
                got = await sub.next_msg(timeout=5)
                check_decodes(got.data, payload, f"{section.title} request")
                await receiver.publish(got.reply, answer.raw if answer else b"{}")

            async with asyncio.TaskGroup() as tg:
                tg.create_task(serve())
                reply = await bus.request(example.subject, example.raw, timeout=5)
            if answer is not None:
                check_decodes(reply.data, reply_type, f"{section.title} reply")

    if "JetStream" in section.rows["Pattern"]:
        # The documented stream captures the subject, and takes the example as it is.
        stream = section.cell("Pattern")
        if stream == subjects.EVENTS_STREAM:
            await OutboxPublisher(MemoryEventStore(), bus).ensure_stream()
        else:
            assert stream == subjects.COMMANDS_STREAM
            await JetStreamCommandQueue.create(bus)
        for example in section.requests:
            ack = await bus.jetstream().publish(example.subject, example.raw, stream=stream)
            assert ack.stream == stream
