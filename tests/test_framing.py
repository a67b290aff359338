"""events/contract/framing.py: the codec both frame protocols share keeps them apart."""

from __future__ import annotations

from types import ModuleType

import msgspec
import pytest

from events.contract import framing, stage_link, tunnel


@pytest.mark.parametrize("kind", [-1, 0x00, 0x7F, 0x100, 2**40])
@pytest.mark.parametrize(("module", "name"), [(tunnel, "tunnel"), (stage_link, "stage link")])
def test_encode_names_a_kind_outside_the_protocol(module: ModuleType, name: str, kind: int) -> None:
    with pytest.raises(ValueError, match=f"^unknown {name} frame kind 0x"):
        module.encode(kind)


def test_each_protocol_raises_its_own_frame_error() -> None:
    unknown = b"\x7f" + bytes(8)
    with pytest.raises(tunnel.FrameError) as caught:
        tunnel.decode(unknown)
    assert not isinstance(caught.value, stage_link.FrameError)
    with pytest.raises(stage_link.FrameError) as other:
        stage_link.decode(unknown)
    assert not isinstance(other.value, tunnel.FrameError)
    assert isinstance(other.value, framing.FrameError)


def test_frames_of_the_two_protocols_never_compare_equal() -> None:
    raw = stage_link.encode_data(3, b"x")  # DATA is 0x03 here, CREDIT in the tunnel
    assert type(stage_link.decode(raw)) is stage_link.Frame
    same_fields: object = tunnel.Frame(stage_link.DATA, 3, None, b"x")
    assert stage_link.Frame(stage_link.DATA, 3, None, b"x") != same_fields
    assert tunnel.Frame(0x7F).kind_name == "0x7f"
    assert stage_link.Frame(stage_link.CLOSE).kind_name == "CLOSE"


def test_a_codec_refuses_tables_that_disagree() -> None:
    class Meta(msgspec.Struct, tag="m"):
        pass

    class Frame(framing.Frame[Meta], frozen=True):
        kind_names = {0x01: "ONE", 0x100: "TOO_BIG"}

    with pytest.raises(ValueError, match="kinds must be bytes"):
        framing.Codec("x", {0x01: Meta, 0x100: None}, frame=Frame, error=framing.FrameError)
    with pytest.raises(ValueError, match="each with a name and a meta type"):
        framing.Codec("x", {0x01: Meta}, frame=Frame, error=framing.FrameError)
