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


def test_probes_default_to_the_agent_settings_and_the_health_path() -> None:
    from events import ProbeSpec
    from nodeagent.workload.probing import ProbeSettings, probe_paths

    spec = parse_toml('name = "x"\ncommand = "c"\nhealth_path = "/healthz"')
    assert spec.probes == ProbeSpec()
    assert probe_paths(spec) == ("/healthz", "/healthz")
    agent = ProbeSettings(readiness_timeout_s=20.0, liveness_failures=5)
    assert agent.for_spec(spec) == agent  # nothing set: the agent's own settings, unchanged
    defaults = ProbeSettings().for_spec(spec)  # and those are today's behaviour
    assert (defaults.readiness_timeout_s, defaults.liveness_interval_s) == (300.0, 2.0)
    assert (defaults.liveness_failures, defaults.liveness_request_timeout_s) == (3, 2.0)


def test_probes_set_in_the_spec_win_over_the_agent_settings() -> None:
    from nodeagent.workload.probing import ProbeSettings, probe_paths

    spec = parse_toml(
        'name = "x"\ncommand = "c"\n[probes]\nreadiness_path = "/ready"\n'
        "readiness_timeout_s = 900\nliveness_interval_s = 5\nliveness_failures = 4\n"
        "liveness_timeout_s = 1.5"
    )
    assert probe_paths(spec) == ("/ready", "/ready")  # liveness defaults to the readiness path
    settings = ProbeSettings(readiness_interval_s=0.05).for_spec(spec)
    assert settings.readiness_timeout_s == 900.0 and settings.readiness_interval_s == 0.05
    assert (settings.liveness_interval_s, settings.liveness_failures) == (5.0, 4)
    assert settings.liveness_request_timeout_s == 1.5 and settings.request_timeout_s == 2.0
    split = parse_toml('name = "x"\ncommand = "c"\n[probes]\nliveness_path = "/live"')
    assert probe_paths(split) == ("/health", "/live")


@pytest.mark.parametrize(
    ("probes", "message"),
    [
        ('readiness_path = "ready"', "probes.readiness_path: must start with /"),
        ('liveness_path = ""', "probes.liveness_path: must start with /"),
        ("readiness_timeout_s = 0", "probes.readiness_timeout_s: must be a finite number > 0"),
        ("liveness_interval_s = -1", "probes.liveness_interval_s: must be a finite number > 0"),
        ("liveness_timeout_s = inf", "probes.liveness_timeout_s: must be a finite number > 0"),
        ("liveness_failures = 0", "probes.liveness_failures: must be at least 1, got 0"),
        ('liveness_failures = "3"', "probes.liveness_failures: Expected `int | null`, got `str`"),
        ('readiness_timeout_s = "5m"', "probes.readiness_timeout_s: Expected `float | null`"),
    ],
)
def test_bad_probes_name_the_field_and_the_problem(probes: str, message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_toml(f'name = "x"\ncommand = "c"\n[probes]\n{probes}')
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_a_spec_written_before_probes_existed_decodes_and_encodes_unchanged() -> None:
    import msgspec

    from events import ClusterSpecChanged, ProbeSpec

    # As an older release stored them: no `probes` key, so every probe setting is unset.
    old = b'{"type":"cluster.created.v1","spec":{"name":"llama","command":"c","health_path":"/h"}}'
    event = decode_payload("cluster.created.v1", old)
    assert isinstance(event, ClusterCreated)
    assert event.spec.probes == ProbeSpec() and event.spec.health_path == "/h"
    assert msgspec.json.encode(event) == old  # the default is omitted: the same bytes again
    changed = (
        b'{"type":"cluster.spec_changed.v1","spec":{"name":"llama","command":"c"},"revision":2}'
    )
    later = decode_payload("cluster.spec_changed.v1", changed)
    assert isinstance(later, ClusterSpecChanged) and later.spec.probes == ProbeSpec()


def test_the_docker_section_parses() -> None:
    spec = parse_toml(
        'name = "sgl"\nimage = "lmsysorg/sglang:latest"\n[docker]\nipc = "host"\n'
        'shm_size = "32g"\nvolumes = ["/models/hf:/root/.cache/huggingface", "cache:/c:ro"]\n'
        'pull = "always"\n'
    )
    assert spec.docker.ipc == "host" and spec.docker.shm_size == "32g"
    assert spec.docker.volumes == ("/models/hf:/root/.cache/huggingface", "cache:/c:ro")
    assert spec.docker.pull == "always"
    assert parse_toml('name = "x"\nimage = "i"').docker.pull == "missing"


@pytest.mark.parametrize(
    ("docker", "message"),
    [
        ('ipc = "hots"', "docker.ipc: 'hots' is not one of host, private, shareable"),
        ('shm_size = "lots"', "docker.shm_size: 'lots' is not a size such as 16g or 512m"),
        ('shm_size = "0g"', "docker.shm_size: '0g' is not a size"),
        ('pull = "sometimes"', "docker.pull: 'sometimes' is not one of missing, always, never"),
        ('volumes = ["/models"]', "docker.volumes[0]: '/models' is not HOST:CONTAINER"),
        ('volumes = ["/a:/b", "/m:relative"]', "docker.volumes[1]: '/m:relative' is not"),
        ('volumes = ["/a:/b:rx"]', "docker.volumes[0]: '/a:/b:rx' is not"),
        ('volumes = "/a:/b"', "docker.volumes: Expected `array`, got `str`"),
    ],
)
def test_bad_docker_sections_name_the_field(docker: str, message: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_toml(f'name = "x"\nimage = "i"\n[docker]\n{docker}\n')
    assert str(info.value).startswith(message)
    assert "\n" not in str(info.value)


def test_a_spec_written_before_the_docker_section_encodes_unchanged() -> None:
    import msgspec

    old = b'{"type":"cluster.created.v1","spec":{"name":"llama","image":"i"}}'
    event = decode_payload("cluster.created.v1", old)
    assert isinstance(event, ClusterCreated) and event.spec.docker.pull == "missing"
    assert msgspec.json.encode(event) == old


def test_every_engine_template_in_the_workloads_doc_parses() -> None:
    import shlex

    from nodeagent.workload.engines import INSTALL_HINTS

    doc = (Path(__file__).resolve().parents[2] / "docs" / "workloads.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)```", doc, re.S)
    assert len(blocks) >= 6
    for block in blocks:
        spec = parse_toml(block, source="docs/workloads.md")
        assert spec.model, spec.name  # each says what clients send
        if not spec.image:
            program = shlex.split(spec.command)[0]
            # A missing engine is named with how to install it (not python's or sh's own).
            assert program in INSTALL_HINTS or program in ("python", "sh"), program
        if "{model}" not in spec.command:
            # An engine that cannot be told the name answers to its own (Ollama) or to any.
            assert spec.name in ("ollama-llama", "bge"), spec.name


@pytest.mark.parametrize(
    "files", ["../etc/passwd", "/abs/path", "a/b/c", "org/..", "has space", "x\ny"]
)
def test_model_files_must_be_a_repo_id_or_a_name_in_the_cache(files: str) -> None:
    with pytest.raises(SpecError) as info:
        from actors.spec import from_mapping

        from_mapping({"name": "x", "command": "c", "model_files": files})
    assert str(info.value).startswith("model_files: ")
    assert "\n" not in str(info.value)


def test_model_files_and_the_cache_placeholder_parse() -> None:
    spec = parse_toml(
        'name = "x"\nimage = "i"\nmodel_files = "meta-llama/Llama-3.1-8B-Instruct"\n'
        '[docker]\nvolumes = ["{model_cache}:/root/.cache/huggingface:ro"]\n'
    )
    assert spec.model_files == "meta-llama/Llama-3.1-8B-Instruct"
    assert spec.docker.volumes == ("{model_cache}:/root/.cache/huggingface:ro",)
