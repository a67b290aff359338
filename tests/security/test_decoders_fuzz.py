"""Every decoder of outside input, fed garbage by hypothesis: it either decodes or raises its
own one-line error; nothing else escapes (no crash, no hang, no traceback for the user)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from actors.spec import SpecError, from_mapping, parse_toml
from events import codec
from events.contract import tunnel
from events.contract.messages import (
    ApiReply,
    Fault,
    Heartbeat,
    Register,
    ReplicaReport,
    ReplicaSuspicion,
    RoutingUpdate,
)
from gateway.auth import KeyFileError, KeyRing

# JSON-shaped garbage: what a confused or hostile publisher would most likely send.
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner),
    max_leaves=20,
)
KNOWN_KEYS = ["type", "node_id", "seq", "gpus", "replicas", "name", "replicas", "model", "gpu"]
plausible = st.dictionaries(st.sampled_from(KNOWN_KEYS) | st.text(max_size=8), json_values)
payloads = st.binary(max_size=300) | plausible.map(msgspec.json.encode)

MESSAGE_TYPES = [Heartbeat, Register, ReplicaReport, ReplicaSuspicion, RoutingUpdate, Fault]


def _one_line(exc: BaseException) -> None:
    text = str(exc)
    assert text and len(text.splitlines()) <= 3, text  # msgspec adds a path line at most


@given(st.sampled_from(MESSAGE_TYPES), payloads)
def test_subject_payloads_decode_or_raise_a_decode_error(kind: type[Any], data: bytes) -> None:
    try:
        msgspec.json.decode(data, type=kind)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        _one_line(exc)


@given(payloads)
def test_api_replies_decode_or_raise_a_decode_error(data: bytes) -> None:
    try:
        msgspec.json.decode(data, type=ApiReply)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        _one_line(exc)


@given(plausible | json_values)
def test_cluster_specs_are_valid_or_a_spec_error(raw: Any) -> None:
    try:
        spec = from_mapping(raw)
    except SpecError as exc:
        assert "\n" not in str(exc)
    else:
        assert spec.name and spec.replicas >= 0


toml_text = st.text(max_size=200) | st.lists(
    st.tuples(
        st.sampled_from(["name", "replicas", "model", "command", "image", "[gpu]", "count"]),
        st.sampled_from(['"x"', "3", "-1", "1e400", '"' + "a" * 300 + '"', "[1,", "{}", "true"]),
    ),
    max_size=6,
).map(lambda pairs: "\n".join(f"{k} = {v}" if not k.startswith("[") else k for k, v in pairs))


@given(toml_text)
def test_toml_specs_parse_or_raise_one_spec_error(text: str) -> None:
    try:
        parse_toml(text, source="fuzz.toml")
    except SpecError as exc:
        assert "\n" not in str(exc)


frames = st.binary(max_size=200) | st.builds(
    lambda kind, seq, meta, rest: bytes([kind]) + seq + len(meta).to_bytes(4, "big") + meta + rest,
    st.integers(min_value=0, max_value=255),
    st.binary(min_size=4, max_size=4),
    payloads,
    st.binary(max_size=20),
)


@given(frames)
def test_tunnel_frames_decode_or_raise_a_frame_error(data: bytes) -> None:
    try:
        frame = tunnel.decode(data)
    except tunnel.FrameError as exc:
        assert "\n" not in str(exc)
    else:
        assert frame.kind in tunnel.KIND_NAMES


@given(st.text(max_size=60), payloads)
def test_stored_payloads_never_raise(type_tag: str, data: bytes) -> None:
    decoded = codec.decode_payload(type_tag, data)
    assert decoded is not None


@given(payloads)
def test_envelopes_decode_or_raise_a_decode_error(data: bytes) -> None:
    try:
        codec.decode_envelope(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        _one_line(exc)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=300))
def test_key_files_load_or_raise_a_key_file_error(tmp_path: Path, text: str) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(text)
    try:
        KeyRing.load(path)
    except KeyFileError as exc:
        assert "\n" not in str(exc).strip()


@pytest.mark.parametrize("size", [0, 8, 9])
def test_short_frames_name_their_length(size: int) -> None:
    with pytest.raises(tunnel.FrameError):
        tunnel.decode(b"\x00" * size if size < 9 else b"\xff" * size)
