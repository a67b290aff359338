from __future__ import annotations

import re
from pathlib import Path

import pytest

from actors.spec import SpecError, parse_toml
from events import ClusterCreated
from events.codec import decode_payload

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_example_parses() -> None:
    block = re.search(r"```toml\n(.*?)```", README.read_text(), re.S)
    assert block is not None
    spec = parse_toml(block.group(1))
    assert spec.name == "llama" and spec.replicas == 3
    assert spec.gpu.models == ("RTX4090", "A100") and spec.gpu.min_vram_mib == 20000
    assert spec.env == {"HF_HOME": "/models"}
    assert spec.regions == ("eu-west", "eu-central") and spec.preferred_region == "eu-west"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('name = "x"\nreplicas = -1\ncommand = "c"', "replicas: must be 0..1000, got -1"),
        ('name = "x"\nreplicas = "three"\ncommand = "c"', "replicas: Expected `int`, got `str`"),
        ('name = "x"\ncommand = "c"\n[gpu]\ncount = 0', "gpu.count: must be 1..16, got 0"),
        ('name = "has space"\ncommand = "c"', "name: use 1-128 of [A-Za-z0-9_-]"),
        ('name = "x"', "command: give a command or an image"),
        ('replicas = 1\ncommand = "c"', "Object missing required field `name`"),
        ('name = "x"\ncommand = "c"\nhealth_path = "health"', "health_path: must start with /"),
        ("name = ", "spec: not valid TOML"),
        ('name = "x"\ncommand = "c"\nregions = "eu-west"', "regions: Expected `array`, got `str`"),
        ('name = "x"\ncommand = "c"\nregions = [""]', "regions: entries must be non-empty"),
        ('name = "x"\ncommand = "c"\nregions = ["a", "a"]', "regions: 'a' is listed twice"),
        ('name = "x"\ncommand = "c"\nregions = [1]', "regions[0]: Expected `str`, got `int`"),
    ],
)
def test_bad_specs_name_the_field_and_the_problem(text: str, message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_toml(text)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_regions_parse_and_default_to_anywhere() -> None:
    spec = parse_toml('name = "x"\ncommand = "c"\nregions = ["eu-west", "eu-central"]')
    assert spec.regions == ("eu-west", "eu-central")
    assert parse_toml('name = "x"\ncommand = "c"').regions == ()


def test_a_spec_written_before_regions_existed_still_decodes() -> None:
    # A cluster.created.v1 payload as an older release stored it: no `regions` key.
    old = (
        b'{"type":"cluster.created.v1","spec":{"name":"llama","command":"c",'
        b'"preferred_region":"eu-west"}}'
    )
    event = decode_payload("cluster.created.v1", old)
    assert isinstance(event, ClusterCreated)
    assert event.spec.regions == () and event.spec.preferred_region == "eu-west"
