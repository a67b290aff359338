from __future__ import annotations

import re
from pathlib import Path

import pytest

from actors.spec import SpecError, parse_toml

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_example_parses() -> None:
    block = re.search(r"```toml\n(.*?)```", README.read_text(), re.S)
    assert block is not None
    spec = parse_toml(block.group(1))
    assert spec.name == "llama" and spec.replicas == 3
    assert spec.gpu.models == ("RTX4090", "A100") and spec.gpu.min_vram_mib == 20000
    assert spec.env == {"HF_HOME": "/models"}


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
    ],
)
def test_bad_specs_name_the_field_and_the_problem(text: str, message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_toml(text)
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)
